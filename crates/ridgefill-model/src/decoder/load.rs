//! Loading a checkpoint onto a device: names, sizes and finiteness checked; projections held as
//! [`WeightFormat`] says (GGUF blocks for the CPU kernels, packed for a GPU, or dense).

use std::sync::Arc;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_quant::{QMatrix, QWeight, SimdLevel, WeightBytes};

use super::{Block, Decoder, ExecPath, Parts};
use crate::error::{ModelError, Result};
use crate::weight::{Weight, WeightFormat};

/// Options for loading a model onto a device.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub dtype: FloatDType,
    /// Positions the RoPE tables cover (the context the caller intends to use).
    pub max_positions: usize,
    /// How GGUF weights are held.
    pub weights: WeightFormat,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: FloatDType::F32,
            max_positions: 4096,
            weights: WeightFormat::default(),
        }
    }
}

struct Loader<'a> {
    ckpt: &'a Checkpoint,
    device: &'a Device,
    dtype: FloatDType,
    /// Projections are held quantised in this format (`None`: dense tensors).
    blocks: Option<WeightFormat>,
    /// Blocks run on the flex CPU kernels (else they are packed for a GPU).
    flex: bool,
}

impl Loader<'_> {
    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let data = self.ckpt.tensor_f32(name)?;
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(ModelError::TensorSize {
                path: self.ckpt.path.clone(),
                tensor: name.to_string(),
                expected,
                found: data.len(),
                shape: shape.to_vec(),
            });
        }
        if let Some(index) = data.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite {
                path: self.ckpt.path.clone(),
                tensor: name.to_string(),
                index,
            });
        }
        Ok(data)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Tensor<1>> {
        let data = self.host(name, &[len])?;
        Ok(self.upload(data))
    }

    fn upload(&self, data: Vec<f32>) -> Tensor<1> {
        let len = data.len();
        Tensor::<1>::from_data(TensorData::new(data, [len]), self.device).cast(self.dtype)
    }

    /// A norm weight as applied: the stored weight plus the config's offset (Gemma's `1 + w`).
    fn norm(&self, name: &str, len: usize) -> Result<Tensor<1>> {
        let offset = self.ckpt.config.norm_weight_offset as f32;
        let mut data = self.host(name, &[len])?;
        if offset != 0.0 {
            data.iter_mut().for_each(|x| *x += offset);
        }
        Ok(self.upload(data))
    }

    /// Biases of consecutive output parts side by side (zeros for a part without one), or
    /// `None` when no part has one.
    fn fused_bias(&self, parts: &[(String, usize)]) -> Result<Option<Tensor<1>>> {
        if !parts.iter().any(|(n, _)| self.ckpt.has_tensor(n)) {
            return Ok(None);
        }
        let mut data = Vec::new();
        for (name, len) in parts {
            if self.ckpt.has_tensor(name) {
                data.extend(self.host(name, &[*len])?);
            } else {
                data.extend(std::iter::repeat_n(0.0, *len));
            }
        }
        Ok(Some(self.upload(data)))
    }

    /// Loads an HF `[out, in]` weight and stores it as `[in, out]`.
    fn linear_t(&self, name: &str, out: usize, inp: usize) -> Result<Tensor<2>> {
        self.fused_t(&[(name.to_string(), out)], inp)
    }

    /// Loads HF `[out_i, in]` weights and stores them side by side as `[in, Σ out_i]`.
    fn fused_t(&self, parts: &[(String, usize)], inp: usize) -> Result<Tensor<2>> {
        let mut rows = Vec::new();
        let mut total = 0;
        for (name, out) in parts {
            rows.extend(self.host(name, &[*out, inp])?);
            total += out;
        }
        Ok(transposed(&rows, total, inp, self.device).cast(self.dtype))
    }

    /// A projection from HF `[out_i, in]` weights side by side: blocks for the CPU kernels where
    /// the format allows, else a dense `[in, Σ out_i]` tensor.
    fn proj(&self, parts: &[(String, usize)], inp: usize) -> Result<Weight> {
        match self.blocks_of(parts, inp)? {
            Some(q) => match Weight::from_blocks(Arc::new(q), self.device) {
                Some(w) => Ok(w),
                None => Ok(Weight::Dense(self.fused_t(parts, inp)?)),
            },
            None => Ok(Weight::Dense(self.fused_t(parts, inp)?)),
        }
    }

    /// HF `[out_i, in]` weights stacked along their output rows as blocks, or `None` where the
    /// format keeps them dense (a Hugging Face checkpoint at `native`, a type without a kernel).
    fn blocks_of(&self, parts: &[(String, usize)], inp: usize) -> Result<Option<QWeight>> {
        let Some(format) = self.blocks else {
            return Ok(None);
        };
        let mut mats = Vec::with_capacity(parts.len());
        for (name, out) in parts {
            let bad = |e: ridgefill_quant::QError| {
                ModelError::Invalid(format!("{}: tensor {name}: {e}", self.ckpt.path.display()))
            };
            let m = match format {
                WeightFormat::Native => {
                    let Some(st) = self.ckpt.tensor_stored(name)? else {
                        return Ok(None);
                    };
                    if st.shape != [*out, inp] {
                        return Err(ModelError::TensorSize {
                            path: self.ckpt.path.clone(),
                            tensor: name.to_string(),
                            expected: out * inp,
                            found: st.shape.iter().product(),
                            shape: vec![*out, inp],
                        });
                    }
                    let mapped = st.bytes.clone();
                    let bytes = WeightBytes::from_owner(Arc::new(st.bytes), |b| &b[..]);
                    let m = match QMatrix::new(st.ty, *out, inp, bytes) {
                        Err(ridgefill_quant::QError::Unsupported(_)) => return Ok(None),
                        m => m.map_err(bad)?,
                    };
                    self.check_finite(name, &m)?;
                    if !self.flex {
                        // Packed for the GPU from the layout as stored.
                        mats.push(m);
                        continue;
                    }
                    let m = m.prepared_for(SimdLevel::detect());
                    if m.is_row_lanes() {
                        // Rearranged into a copy: the mapped original need not stay resident.
                        mapped.evict();
                    }
                    m
                }
                // f32 stays dense; f16 and q8 are converted here.
                format => {
                    let Some(ty) = format.load_type() else {
                        return Ok(None);
                    };
                    let data = self.host(name, &[*out, inp])?;
                    // Rows that do not fill whole blocks stay dense.
                    let Some(bytes) = ridgefill_io::quant::quantize(ty, &data)
                        .filter(|_| inp.is_multiple_of(ty.block_size()))
                    else {
                        return Ok(None);
                    };
                    let m =
                        QMatrix::new(ty, *out, inp, WeightBytes::from_vec(bytes)).map_err(bad)?;
                    match self.flex {
                        true => m.prepared_for(SimdLevel::detect()),
                        false => m,
                    }
                }
            };
            mats.push(m);
        }
        QWeight::new(mats)
            .map(Some)
            .map_err(|e| ModelError::Invalid(format!("{}: {e}", self.ckpt.path.display())))
    }

    /// Blocks as stored are never dequantised at load, so a NaN or infinity in them (a bad scale
    /// or value) is looked for here, a few rows at a time, as the dense path looks for it.
    fn check_finite(&self, name: &str, m: &QMatrix) -> Result<()> {
        const ROWS: usize = 64;
        let cols = m.cols();
        let mut buf = vec![0f32; ROWS.min(m.rows()) * cols];
        for r0 in (0..m.rows()).step_by(ROWS) {
            let chunk = &mut buf[..ROWS.min(m.rows() - r0) * cols];
            m.dequantize_rows_into(r0, chunk).map_err(|e| {
                ModelError::Invalid(format!("{}: tensor {name}: {e}", self.ckpt.path.display()))
            })?;
            if let Some(i) = chunk.iter().position(|x| !x.is_finite()) {
                return Err(ridgefill_io::IoError::NonFinite {
                    path: self.ckpt.path.clone(),
                    tensor: name.to_string(),
                    index: r0 * cols + i,
                    value: f64::from(chunk[i]),
                }
                .into());
            }
        }
        Ok(())
    }

    /// The embedding `[vocab, hidden]`: blocks where the format allows, else dense.
    fn embedding(&self, name: &str, vocab: usize, d: usize) -> Result<Weight> {
        match self.blocks_of(&[(name.to_string(), vocab)], d)? {
            Some(q) => Ok(Weight::Blocks(Arc::new(q))),
            None => Ok(Weight::Dense(self.matrix(name, vocab, d)?)),
        }
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<2>> {
        let data = self.host(name, &[rows, cols])?;
        Ok(
            Tensor::<2>::from_data(TensorData::new(data, [rows, cols]), self.device)
                .cast(self.dtype),
        )
    }
}

impl Decoder {
    /// Loads every weight of `ckpt` onto `device`, checking names, sizes and finiteness.
    pub fn load(ckpt: &Checkpoint, device: &Device, opts: &LoadOptions) -> Result<Self> {
        // Checked first: a bad switch should not cost a whole load.
        let cpu_kernels = super::cpu_kernels_apply(device, opts.dtype)?;
        super::kv_dtype(cpu_kernels, opts.dtype)?;
        let cfg = ckpt.config.clone();
        if !super::supports(&cfg.model_type) {
            return Err(ModelError::UnsupportedArchitecture {
                path: ckpt.path.clone(),
                found: cfg.model_type.clone(),
            });
        }
        cfg.validate(&ckpt.path)?;
        // The CPU kernels run on the host with f32 activations; GPUs pack Q4_0 … Q6_K and Q8_0
        // made at load (F16 weights stay dense there).
        let flex = crate::device::is_flex(device);
        let blocks = match flex {
            true => opts.weights != WeightFormat::F32 && opts.dtype == FloatDType::F32,
            false => matches!(opts.weights, WeightFormat::Native | WeightFormat::Q8),
        }
        .then_some(opts.weights);
        let ld = Loader {
            ckpt,
            device,
            dtype: opts.dtype,
            blocks,
            flex,
        };
        let d = cfg.hidden_size;
        let q_dim = cfg.num_attention_heads * cfg.head_dim();
        let kv_dim = cfg.kv_dim();
        let ff = cfg.intermediate_size;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let hd = cfg.head_dim();
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = |part: &str, what: &str| format!("{p}.self_attn.{part}.{what}");
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(ld.norm(&attn("q_norm", "weight"), hd)?),
                    Some(ld.norm(&attn("k_norm", "weight"), hd)?),
                )
            } else {
                (None, None)
            };
            let norm = |key: &str| ld.norm(&format!("{p}.{key}.weight"), d);
            // HF's `post_attention_layernorm` is the pre-MLP norm unless the block has sandwich
            // norms (Gemma 3), where it norms the attention output.
            let (post_attn_norm, pre_mlp_norm, post_mlp_norm) = if cfg.sandwich_norms {
                (
                    Some(norm("post_attention_layernorm")?),
                    norm("pre_feedforward_layernorm")?,
                    Some(norm("post_feedforward_layernorm")?),
                )
            } else {
                (None, norm("post_attention_layernorm")?, None)
            };
            let o_bias_name = attn("o_proj", "bias");
            layers.push(Block {
                pre_attn_norm: norm("input_layernorm")?,
                qkv_proj: ld.proj(
                    &[
                        (attn("q_proj", "weight"), q_dim),
                        (attn("k_proj", "weight"), kv_dim),
                        (attn("v_proj", "weight"), kv_dim),
                    ],
                    d,
                )?,
                qkv_bias: ld.fused_bias(&[
                    (attn("q_proj", "bias"), q_dim),
                    (attn("k_proj", "bias"), kv_dim),
                    (attn("v_proj", "bias"), kv_dim),
                ])?,
                q_norm,
                k_norm,
                o_proj: ld.proj(&[(attn("o_proj", "weight"), d)], q_dim)?,
                o_bias: if ckpt.has_tensor(&o_bias_name) {
                    Some(ld.vector(&o_bias_name, d)?)
                } else {
                    None
                },
                post_attn_norm,
                pre_mlp_norm,
                post_mlp_norm,
                gate_up_proj: ld.proj(
                    &[
                        (format!("{p}.mlp.gate_proj.weight"), ff),
                        (format!("{p}.mlp.up_proj.weight"), ff),
                    ],
                    d,
                )?,
                down_proj: ld.proj(&[(format!("{p}.mlp.down_proj.weight"), d)], ff)?,
                window: cfg.layer_window(i),
                local_rope: cfg.layer_uses_local_rope(i),
                path: ExecPath::Generic,
            });
        }
        let embed_name = "model.embed_tokens.weight";
        let embed_tokens = ld.embedding(embed_name, cfg.vocab_size, d)?;
        let tied = cfg.tie_word_embeddings || !ckpt.has_tensor("lm_head.weight");
        let lm_head = match (&embed_tokens, tied) {
            // The tied head reads the embedding's own blocks: no second copy on the CPU.
            (Weight::Blocks(q), true) => match Weight::from_blocks(q.clone(), device) {
                Some(w) => w,
                None => Weight::Dense(ld.linear_t(embed_name, cfg.vocab_size, d)?),
            },
            (_, true) => Weight::Dense(ld.linear_t(embed_name, cfg.vocab_size, d)?),
            (_, false) => ld.proj(&[("lm_head.weight".to_string(), cfg.vocab_size)], d)?,
        };
        let norm = ld.norm("model.norm.weight", d)?;
        let divisors = super::rope::rope_divisors(ckpt, &cfg)?;
        Decoder::assemble(
            Parts {
                config: cfg,
                embed_tokens,
                layers,
                norm,
                lm_head,
                divisors,
                max_positions: opts.max_positions,
            },
            device,
            opts.dtype,
        )
    }
}

/// Host-side transpose of a row-major `[rows, cols]` matrix into a `[cols, rows]` tensor.
fn transposed(data: &[f32], rows: usize, cols: usize, device: &Device) -> Tensor<2> {
    let mut t = vec![0.0f32; data.len()];
    for (r, row) in data.chunks_exact(cols).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            t[c * rows + r] = x;
        }
    }
    Tensor::from_data(TensorData::new(t, [cols, rows]), device)
}
