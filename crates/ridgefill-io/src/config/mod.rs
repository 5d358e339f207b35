//! Model hyper-parameters, read from a Hugging Face `config.json` (`hf.rs`) or from GGUF metadata
//! (`gguf.rs`), checked by `validate.rs`; the types and what the decoder asks of them live here.

mod gguf;
mod hf;
mod validate;

use serde::{Deserialize, Serialize};

use crate::error::{IoError, Result};
use crate::gguf::GgufFile;

/// HF's Llama default when `rms_norm_eps` is absent.
const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;
/// HF's Llama default when `rope_theta` is absent.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// HF's Llama default when `max_position_embeddings` is absent.
const DEFAULT_MAX_POSITION_EMBEDDINGS: usize = 2048;
/// Llama 3.x rope scaling parameters that llama.cpp bakes into `rope_freqs.weight`.
const LLAMA3_LOW_FREQ_FACTOR: f64 = 1.0;
const LLAMA3_HIGH_FREQ_FACTOR: f64 = 4.0;
const LLAMA3_ORIGINAL_CONTEXT: usize = 8192;
/// Relative tolerance when checking a `rope_freqs` tensor against the llama3 formula.
const ROPE_FREQS_TOLERANCE: f64 = 1e-3;
/// The GGUF tensor holding per-dimension rope frequency divisors.
pub const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";
/// `rope_type` reported when a GGUF carries rope_freqs that do not match the llama3 formula.
pub const ROPE_TYPE_GGUF_FREQS: &str = "gguf_rope_freqs";

/// `eos_token_id` in HF configs is either one id or a list.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

impl EosIds {
    /// All ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            EosIds::One(id) => vec![*id],
            EosIds::Many(ids) => ids.clone(),
        }
    }
}

/// HF `rope_scaling` (or the scaling part of transformers v5 `rope_parameters`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct RopeScaling {
    /// Current HF key, e.g. "llama3", "linear", "yarn".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    /// Legacy HF key for the same thing.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
}

impl RopeScaling {
    /// The scaling kind from whichever key is present.
    pub fn kind(&self) -> Option<&str> {
        self.rope_type.as_deref().or(self.legacy_type.as_deref())
    }
}

/// Decoder families the engine implements; their differences are data on [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3, SmolLM, TinyLlama, Mistral.
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v biases.
    Qwen2,
    /// Qwen3: per-head q/k RMSNorm.
    Qwen3,
    /// Gemma 3 (text): q/k norm, (1 + w) norms, sandwich norms, GeGLU, scaled embeddings,
    /// interleaved sliding-window and global layers with their own RoPE bases.
    Gemma3,
}

impl Family {
    /// The family of a HF `model_type` (GGUF architectures are mapped to these first).
    pub fn of_model_type(model_type: &str) -> Option<Family> {
        Some(match model_type {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3_text" | "gemma3" => Family::Gemma3,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen).
    #[default]
    #[serde(rename = "silu")]
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    #[serde(rename = "gelu_pytorch_tanh")]
    GeluTanh,
}

impl Activation {
    /// HF `hidden_act` / `hidden_activation` names.
    pub fn parse(name: &str) -> Option<Activation> {
        Some(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
            _ => return None,
        })
    }
}

/// HF `layer_types` entries.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub enum LayerType {
    #[serde(rename = "full_attention")]
    Full,
    #[serde(rename = "sliding_attention")]
    Sliding,
}

impl LayerType {
    fn parse(name: &str) -> Option<LayerType> {
        Some(match name {
            "full_attention" => LayerType::Full,
            "sliding_attention" => LayerType::Sliding,
            _ => return None,
        })
    }
}

/// Gemma 3 defaults (transformers' `Gemma3TextConfig`).
const GEMMA3_SLIDING_WINDOW: usize = 4096;
const GEMMA3_SLIDING_PATTERN: usize = 6;
const GEMMA3_LOCAL_ROPE_THETA: f64 = 10_000.0;
const GEMMA3_ROPE_THETA: f64 = 1_000_000.0;
const GEMMA3_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
const GEMMA3_HEAD_DIM: usize = 256;
const GEMMA3_MAX_POSITIONS: usize = 131_072;
/// Qwen3's default `head_dim` (transformers' `Qwen3Config`).
const QWEN3_HEAD_DIM: usize = 128;
/// Qwen2's default `max_window_layers`: layers below it never slide.
const QWEN2_MAX_WINDOW_LAYERS: usize = 28;
/// llama.cpp's Gemma 3 27B attention scale uses hidden / heads instead of head_dim; it is
/// recognised by its layer count, as llama.cpp does.
const GEMMA3_27B_LAYERS: usize = 62;

/// Architecture hyper-parameters (HF `config.json` field names).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(try_from = "serde_json::Value")]
pub struct ModelConfig {
    pub architectures: Vec<String>,
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<EosIds>,
    pub torch_dtype: Option<String>,
    // Per-family switches, resolved from `model_type` and the family's transformers defaults.
    /// Q/K/V projections carry biases (Qwen2 always; Llama/Qwen3 when `attention_bias`).
    pub attention_bias: bool,
    /// Per-head RMSNorm of Q and K before RoPE (`q_norm`, `k_norm`: Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Added to every RMSNorm weight on load: 1 for Gemma's `(1 + w)` norms as HF stores them,
    /// 0 where the checkpoint already holds `1 + w` (llama.cpp's Gemma GGUF) or plain weights.
    pub norm_weight_offset: f64,
    /// Gemma 3's four norms per block: `post_attention_layernorm` on the attention output,
    /// `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP.
    pub sandwich_norms: bool,
    /// The MLP gate's activation (HF `hidden_act`, or Gemma's `hidden_activation`).
    pub hidden_act: Activation,
    /// Embeddings multiplied by this (Gemma: √hidden, rounded to the activation dtype).
    pub embed_scale: Option<f64>,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`.
    pub query_pre_attn_scalar: Option<f64>,
    /// `cap · tanh(score / cap)` on attention scores.
    pub attn_logit_softcapping: Option<f64>,
    /// `cap · tanh(logit / cap)` on output logits.
    pub final_logit_softcapping: Option<f64>,
    /// Whether `sliding_window` is in effect (Qwen's switch; set whenever a window applies).
    pub use_sliding_window: bool,
    /// Keys a sliding-window layer's query sees, itself included (`q - k < window`).
    pub sliding_window: Option<usize>,
    /// Per layer, full or sliding-window attention, when the config lists them; empty, the
    /// layers follow `sliding_window_pattern`, else `max_window_layers`, else all slide
    /// (see [`ModelConfig::layer_window`]). Never built from a layer count alone, which comes
    /// from the file and may be absurd.
    pub layer_types: Vec<LayerType>,
    /// Every `n`-th layer (1-based) is global, the others slide (Gemma 3: 6).
    pub sliding_window_pattern: Option<usize>,
    /// Layers from this index on slide (Qwen2/Qwen3 with `use_sliding_window`).
    pub max_window_layers: Option<usize>,
    /// RoPE base of sliding-window layers (Gemma 3), which also skip `rope_scaling`.
    pub rope_local_base_freq: Option<f64>,
}

impl ModelConfig {
    /// Per-head dimension: explicit `head_dim`, else hidden / heads.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Width of the K (and V) projections: kv heads x head dim.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim()
    }

    /// Width of the Q projection: heads x head dim.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    /// The decoder family of `model_type`, if the engine implements it.
    pub fn family(&self) -> Option<Family> {
        Family::of_model_type(&self.model_type)
    }

    /// Layer `l`'s attention window (keys a query sees, itself included), `None` for full
    /// attention.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        let w = self.sliding_window?;
        let sliding = if !self.layer_types.is_empty() {
            self.layer_types.get(l) == Some(&LayerType::Sliding)
        } else if let Some(p) = self.sliding_window_pattern {
            p > 0 && !(l + 1).is_multiple_of(p)
        } else if let Some(from) = self.max_window_layers {
            l >= from
        } else {
            true
        };
        sliding.then_some(w)
    }

    /// Whether layer `l` rotates with the local RoPE base (and no scaling): Gemma 3's sliding
    /// layers.
    pub fn layer_uses_local_rope(&self, l: usize) -> bool {
        self.rope_local_base_freq.is_some() && self.layer_window(l).is_some()
    }

    /// Attention score scale: `query_pre_attn_scalar^-1/2`, else `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim() as f64)
            .sqrt()
    }

    /// The features this config switches on beyond plain Llama, for `info` and errors.
    pub fn features(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.attention_bias {
            f.push("q/k/v biases".to_string());
        }
        if self.qk_norm {
            f.push("q/k RMSNorm".to_string());
        }
        if self.norm_weight_offset != 0.0 {
            f.push(format!("norm weights + {}", self.norm_weight_offset));
        }
        if self.sandwich_norms {
            f.push("pre/post norms around attention and MLP".to_string());
        }
        if self.hidden_act == Activation::GeluTanh {
            f.push("GeGLU (gelu tanh)".to_string());
        }
        if let Some(s) = self.embed_scale {
            f.push(format!("embeddings x {s:.4}"));
        }
        if let Some(q) = self.query_pre_attn_scalar {
            f.push(format!("attention scale {q}^-1/2"));
        }
        if let Some(c) = self.attn_logit_softcapping {
            f.push(format!("attention soft-cap {c}"));
        }
        if let Some(c) = self.final_logit_softcapping {
            f.push(format!("final logit soft-cap {c}"));
        }
        if let Some(w) = self.sliding_window {
            let sliding = (0..self.num_hidden_layers)
                .filter(|&l| self.layer_window(l).is_some())
                .count();
            f.push(format!(
                "sliding window {w} on {sliding} of {} layers",
                self.num_hidden_layers
            ));
        }
        if let Some(t) = self.rope_local_base_freq {
            f.push(format!("local RoPE base {t}"));
        }
        f
    }

    /// All EOS ids from `eos_token_id` (empty when absent).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(EosIds::to_vec)
            .unwrap_or_default()
    }
}

/// Per-pair divisors of the base inverse frequencies under llama3 scaling (what llama.cpp stores).
pub fn llama3_rope_divisors(s: &RopeScaling, rope_theta: f64, head_dim: usize) -> Vec<f64> {
    let factor = s.factor.unwrap_or(1.0);
    let low = s.low_freq_factor.unwrap_or(LLAMA3_LOW_FREQ_FACTOR);
    let high = s.high_freq_factor.unwrap_or(LLAMA3_HIGH_FREQ_FACTOR);
    let old_ctx = s
        .original_max_position_embeddings
        .unwrap_or(LLAMA3_ORIGINAL_CONTEXT) as f64;
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    (0..head_dim / 2)
        .map(|i| {
            let inv_freq = 1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::gguf::decimal_f64;
    use super::*;

    #[test]
    fn hf_defaults_and_eos_forms() {
        let c: ModelConfig = serde_json::from_str(
            r#"{"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,"eos_token_id":[1,2],"unknown":3}"#,
        )
        .unwrap();
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim(), 16);
        assert_eq!(c.rope_theta, DEFAULT_ROPE_THETA);
        assert_eq!(c.eos_ids(), vec![1, 2]);
        let back: ModelConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn v5_rope_parameters() {
        let c: ModelConfig = serde_json::from_str(
            r#"{"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,
                "rope_parameters":{"rope_theta":500000.0,"rope_type":"llama3","factor":8.0}}"#,
        )
        .unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling.unwrap().kind(), Some("llama3"));
    }

    #[test]
    fn decimal_roundtrip() {
        assert_eq!(decimal_f64(1e-5), 1e-5);
        assert_eq!(decimal_f64(100000.0), 100000.0);
    }
}
