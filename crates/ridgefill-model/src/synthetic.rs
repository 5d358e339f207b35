//! Random-weight models of real architectures' shapes: benchmarks and cross-backend parity checks
//! on machines that hold no checkpoint. Weights come from a seeded host generator, so every
//! device gets bit-identical weights.

use std::sync::Arc;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use ridgefill_io::GgmlType;
use ridgefill_io::config::ModelConfig;
use ridgefill_quant::{QMatrix, QWeight, SimdLevel, WeightBytes};

use crate::decoder::{Block, Decoder, ExecPath, Parts};
use crate::error::{ModelError, Result};
use crate::weight::{Weight, WeightFormat};

/// Model names accepted after `synthetic:`.
pub const SHAPES: &[&str] = &["smollm2-135m", "llama-1b"];

/// The HF `config.json` of a named shape: SmolLM2-135M, or Llama 3.2 1B without its rope scaling.
pub fn shape(name: &str) -> Result<ModelConfig> {
    let json = match name {
        "smollm2-135m" => serde_json::json!({
            "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
            "max_position_embeddings": 8192, "tie_word_embeddings": true
        }),
        "llama-1b" => serde_json::json!({
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": true
        }),
        other => {
            return Err(ModelError::Invalid(format!(
                "unknown synthetic shape {other:?} (expected one of {})",
                SHAPES.join(", ")
            )));
        }
    };
    serde_json::from_value(json).map_err(|e| ModelError::Invalid(format!("shape {name}: {e}")))
}

/// The block type synthetic weights are held in: `native` stands for a typical 4-bit GGUF.
pub fn block_type(weights: WeightFormat) -> Option<GgmlType> {
    match weights {
        WeightFormat::Native => Some(GgmlType::Q4_0),
        other => other.load_type(),
    }
}

/// A block type the GPU kernel cannot read (filtered out before any weight is made).
fn unpacked() -> ModelError {
    ModelError::Invalid("synthetic weights: block type has no packed GPU form".into())
}

/// SplitMix64: tiny, fast and the same everywhere.
struct SplitMix(u64);

/// SplitMix64's state increment.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `[-1, 1)`.
    fn next_sym(&mut self) -> f32 {
        sym(self.next_u64())
    }

    /// The `t`-th value [`SplitMix::next_sym`] would return from this state, without the `t`
    /// before it: block weights are generated in their transposed order.
    fn sym_at(&self, t: u64) -> f32 {
        sym(mix(self.0.wrapping_add(GOLDEN.wrapping_mul(t + 1))))
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `[-1, 1)` from 24 random bits.
fn sym(u: u64) -> f32 {
    const MANTISSA: u32 = 24;
    let u = (u >> (64 - MANTISSA)) as f32 / (1u32 << MANTISSA) as f32;
    2.0 * u - 1.0
}

struct Gen<'a> {
    seed: u64,
    tensor: u64,
    device: &'a Device,
    dtype: FloatDType,
}

impl Gen<'_> {
    /// Uniform weights with variance `1 / fan_in` (so activations keep their scale), `[rows, cols]`.
    fn matrix(&mut self, rows: usize, cols: usize, fan_in: usize) -> Tensor<2> {
        let scale = (3.0 / fan_in as f32).sqrt();
        let data = self.values(rows * cols, |r| scale * r);
        Tensor::<2>::from_data(TensorData::new(data, [rows, cols]), self.device).cast(self.dtype)
    }

    /// Norm weights near 1.
    fn norm(&mut self, len: usize) -> Tensor<1> {
        const SPREAD: f32 = 0.1;
        let data = self.values(len, |r| 1.0 + SPREAD * r);
        Tensor::<1>::from_data(TensorData::new(data, [len]), self.device).cast(self.dtype)
    }

    /// Values uniform in `[-spread, spread)`.
    fn vector(&mut self, len: usize, spread: f32) -> Tensor<1> {
        let data = self.values(len, |r| spread * r);
        Tensor::<1>::from_data(TensorData::new(data, [len]), self.device).cast(self.dtype)
    }

    fn values(&mut self, n: usize, f: impl Fn(f32) -> f32) -> Vec<f32> {
        let mut rng = self.stream();
        (0..n).map(|_| f(rng.next_sym())).collect()
    }

    /// One stream per tensor, so a tensor's values do not depend on the ones made before it.
    fn stream(&mut self) -> SplitMix {
        self.tensor += 1;
        SplitMix(self.seed ^ self.tensor.wrapping_mul(0x2545_f491_4f6c_dd1d))
    }

    /// [`Gen::matrix`] as `ty` blocks when given, else dense.
    fn weight(
        &mut self,
        rows: usize,
        cols: usize,
        fan_in: usize,
        ty: Option<GgmlType>,
    ) -> Result<Weight> {
        match ty {
            None => Ok(Weight::Dense(self.matrix(rows, cols, fan_in))),
            Some(ty) => {
                let q = Arc::new(self.blocks(rows, cols, fan_in, true, ty)?);
                Weight::from_blocks(q, self.device).ok_or_else(unpacked)
            }
        }
    }

    /// The values [`Gen::matrix`] would make, quantised to `ty` blocks along HF `[out, in]` rows:
    /// the transpose of the `[rows, cols]` matrix when `transposed` (projections are stored
    /// `[in, out]`), else the matrix itself (the embedding). Built row by row on every core, so
    /// a 1B model never exists in f32.
    fn blocks(
        &mut self,
        rows: usize,
        cols: usize,
        fan_in: usize,
        transposed: bool,
        ty: GgmlType,
    ) -> Result<QWeight> {
        let scale = (3.0 / fan_in as f32).sqrt();
        let rng = self.stream();
        let (out, inp) = if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        let index = |o: usize, i: usize| if transposed { i * cols + o } else { o * cols + i } as u64;
        let row_bytes = inp / ty.block_size() * ty.type_size();
        let bad = || {
            ModelError::Invalid(format!(
                "synthetic weights: {inp} columns do not fill {ty} blocks"
            ))
        };
        if !inp.is_multiple_of(ty.block_size()) {
            return Err(bad());
        }
        // Written in place, one share of the rows per thread: no second copy at any point.
        let mut bytes = vec![0u8; out * row_bytes];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = out.div_ceil(threads);
        let done = std::thread::scope(|s| {
            let jobs: Vec<_> = bytes
                .chunks_mut(per * row_bytes)
                .enumerate()
                .map(|(t, share)| {
                    let (rng, index) = (&rng, &index);
                    s.spawn(move || {
                        let mut row = vec![0.0f32; inp];
                        for (k, dst) in share.chunks_exact_mut(row_bytes).enumerate() {
                            let o = t * per + k;
                            for (i, x) in row.iter_mut().enumerate() {
                                *x = scale * rng.sym_at(index(o, i));
                            }
                            dst.copy_from_slice(&ridgefill_io::quant::quantize(ty, &row)?);
                        }
                        Some(())
                    })
                })
                .collect();
            jobs.into_iter().all(|j| j.join().ok().flatten().is_some())
        });
        if !done {
            return Err(bad());
        }
        // The row-lane layout is for the CPU kernels; a GPU packs the blocks as stored.
        let flex = crate::device::is_flex(self.device);
        let m = QMatrix::new(ty, out, inp, WeightBytes::from_vec(bytes))
            .map(|m| match flex {
                true => m.prepared_for(SimdLevel::detect()),
                false => m,
            })
            .and_then(|m| QWeight::new(vec![m]))
            .map_err(|e| ModelError::Invalid(format!("synthetic weights: {e}")))?;
        Ok(m)
    }
}

impl Decoder {
    /// A model of `config`'s shape with seeded random weights, built directly on `device`.
    pub fn random(
        config: ModelConfig,
        device: &Device,
        dtype: FloatDType,
        max_positions: usize,
        seed: u64,
    ) -> Result<Self> {
        Self::random_with(
            config,
            device,
            dtype,
            WeightFormat::F32,
            max_positions,
            seed,
        )
    }

    /// [`Decoder::random`] with weights held as `weights` says ([`block_type`]) where the
    /// quantised CPU kernels run or packed on a GPU (not f16), dense elsewhere. Block weights
    /// are the dense model's values quantised, with the tied head's `1/√hidden` moved into the
    /// final norm.
    pub fn random_with(
        config: ModelConfig,
        device: &Device,
        dtype: FloatDType,
        weights: WeightFormat,
        max_positions: usize,
        seed: u64,
    ) -> Result<Self> {
        let cpu_kernels = crate::decoder::cpu_kernels_apply(device, dtype)?;
        // Blocks run on the CPU kernels (f32 activations) or packed on a GPU.
        let gpu = !crate::device::is_flex(device);
        let packs = |t: &GgmlType| ridgefill_io::quant::scaled_int_shape(*t).is_some();
        let ty = block_type(weights).filter(|t| cpu_kernels || (gpu && packs(t)));
        let d = config.hidden_size;
        let (q_dim, kv_dim, ff) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
        let mut g = Gen {
            seed,
            tensor: 0,
            device,
            dtype,
        };
        let hd = config.head_dim();
        // The base tensors first, in the same order as always, so a Llama config's weights do
        // not depend on the switches other families add.
        let mut layers: Vec<Block> = (0..config.num_hidden_layers)
            .map(|l| {
                Ok(Block {
                    pre_attn_norm: g.norm(d),
                    qkv_proj: g.weight(d, q_dim + 2 * kv_dim, d, ty)?,
                    qkv_bias: None,
                    q_norm: None,
                    k_norm: None,
                    o_proj: g.weight(q_dim, d, q_dim, ty)?,
                    o_bias: None,
                    post_attn_norm: None,
                    pre_mlp_norm: g.norm(d),
                    post_mlp_norm: None,
                    gate_up_proj: g.weight(d, 2 * ff, d, ty)?,
                    down_proj: g.weight(ff, d, ff, ty)?,
                    window: config.layer_window(l),
                    local_rope: config.layer_uses_local_rope(l),
                    path: ExecPath::Generic,
                })
            })
            .collect::<Result<_>>()?;
        // Embedding rows of unit scale; the head is the tied embedding, transposed, over √d.
        let head_scale = 1.0 / (d as f32).sqrt();
        let (embed_tokens, mut lm_head, norm) = match ty {
            None => {
                let e = g.matrix(config.vocab_size, d, 1);
                let head = Weight::Dense(e.clone().transpose() * head_scale);
                (Weight::Dense(e), head, g.norm(d))
            }
            Some(ty) => {
                let q = Arc::new(g.blocks(config.vocab_size, d, 1, false, ty)?);
                let head =
                    Weight::from_blocks(q.clone(), device).expect("synthetic block types pack");
                let e = Weight::Blocks(q);
                // Block heads have no scale of their own: the final norm (the head's only
                // input) carries the tied head's.
                let norm = g.norm(d);
                let norm = match config.tie_word_embeddings {
                    true => norm * head_scale,
                    false => norm,
                };
                (e, head, norm)
            }
        };
        // The family's optional tensors.
        for layer in &mut layers {
            if config.attention_bias {
                // Biases of the scale of a projection's output.
                layer.qkv_bias = Some(g.vector(q_dim + 2 * kv_dim, 0.5));
            }
            if config.qk_norm {
                layer.q_norm = Some(g.norm(hd));
                layer.k_norm = Some(g.norm(hd));
            }
            if config.sandwich_norms {
                // Drawn in the order of the HF keys: the base draw (`post_attention_layernorm`)
                // norms the attention output here, then the MLP's pre- and post-norms.
                layer.post_attn_norm = Some(std::mem::replace(&mut layer.pre_mlp_norm, g.norm(d)));
                layer.post_mlp_norm = Some(g.norm(d));
            }
        }
        if !config.tie_word_embeddings {
            lm_head = g.weight(d, config.vocab_size, d, ty)?;
        }
        Decoder::assemble(
            Parts {
                config,
                embed_tokens,
                layers,
                norm,
                lm_head,
                divisors: None,
                max_positions,
            },
            device,
            dtype,
        )
    }
}
