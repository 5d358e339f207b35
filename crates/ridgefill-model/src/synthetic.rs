//! Random-weight models of real architectures' shapes: benchmarks and cross-backend parity checks
//! on machines that hold no checkpoint. Weights come from a seeded host generator, so every
//! device gets bit-identical weights.

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use ridgefill_io::config::ModelConfig;

use crate::error::{ModelError, Result};
use crate::llama::{Llama, LlamaLayer};
use crate::weight::Weight;

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

/// SplitMix64: tiny, fast and the same everywhere.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn next_sym(&mut self) -> f32 {
        const MANTISSA: u32 = 24;
        let u = (self.next_u64() >> (64 - MANTISSA)) as f32 / (1u32 << MANTISSA) as f32;
        2.0 * u - 1.0
    }
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
        // One stream per tensor, so a tensor's values do not depend on the ones made before it.
        self.tensor += 1;
        let mut rng = SplitMix(self.seed ^ self.tensor.wrapping_mul(0x2545_f491_4f6c_dd1d));
        (0..n).map(|_| f(rng.next_sym())).collect()
    }
}

impl Llama {
    /// A model of `config`'s shape with seeded random weights, built directly on `device`.
    pub fn random(
        config: ModelConfig,
        device: &Device,
        dtype: FloatDType,
        max_positions: usize,
        seed: u64,
    ) -> Result<Self> {
        let cpu_kernels = crate::llama::cpu_kernels_apply(device, dtype)?;
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
        let mut layers: Vec<LlamaLayer> = (0..config.num_hidden_layers)
            .map(|l| LlamaLayer {
                input_layernorm: g.norm(d),
                qkv_proj: Weight::Dense(g.matrix(d, q_dim + 2 * kv_dim, d)),
                qkv_bias: None,
                q_norm: None,
                k_norm: None,
                o_proj: Weight::Dense(g.matrix(q_dim, d, q_dim)),
                o_bias: None,
                post_attention_layernorm: g.norm(d),
                pre_feedforward_layernorm: None,
                post_feedforward_layernorm: None,
                gate_up_proj: Weight::Dense(g.matrix(d, 2 * ff, d)),
                down_proj: Weight::Dense(g.matrix(ff, d, ff)),
                window: config.layer_window(l),
                local_rope: config.layer_uses_local_rope(l),
            })
            .collect();
        // Embedding rows of unit scale; the head is the tied embedding, transposed.
        let embed_tokens = g.matrix(config.vocab_size, d, 1);
        let mut lm_head = embed_tokens.clone().transpose() / (d as f32).sqrt();
        let norm = g.norm(d);
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
                layer.pre_feedforward_layernorm = Some(g.norm(d));
                layer.post_feedforward_layernorm = Some(g.norm(d));
            }
        }
        if !config.tie_word_embeddings {
            lm_head = g.matrix(d, config.vocab_size, d);
        }
        let (rope, rope_local) =
            crate::llama::ropes(&config, None, max_positions.max(1), dtype, device);
        Ok(Self {
            config,
            embed_tokens: Weight::Dense(embed_tokens),
            layers,
            norm,
            lm_head: Weight::Dense(lm_head),
            rope,
            rope_local,
            device: device.clone(),
            dtype,
            cpu_kernels,
        })
    }
}
