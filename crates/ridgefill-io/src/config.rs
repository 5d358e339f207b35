//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

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

/// What `config.json` may contain; defaults and renamed fields are resolved into [`ModelConfig`].
#[derive(Deserialize)]
struct RawModelConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: String,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    rms_norm_eps: Option<f64>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    vocab_size: usize,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<EosIds>,
    #[serde(default)]
    torch_dtype: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    qk_norm: Option<bool>,
    #[serde(default)]
    norm_weight_offset: Option<f64>,
    #[serde(default)]
    sandwich_norms: Option<bool>,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    hidden_activation: Option<String>,
    #[serde(default)]
    embed_scale: Option<f64>,
    #[serde(default)]
    query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    max_window_layers: Option<usize>,
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
}

/// transformers v5 `rope_parameters`: one set, or (Gemma 3) one per layer type.
#[derive(Default)]
struct RopeParams {
    theta: Option<f64>,
    scaling: Option<RopeScaling>,
    local_theta: Option<f64>,
}

fn rope_params(v: Option<&serde_json::Value>) -> std::result::Result<RopeParams, String> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeParams::default());
    };
    let one =
        |v: &serde_json::Value| -> std::result::Result<(Option<f64>, Option<RopeScaling>), String> {
            let theta = v.get("rope_theta").and_then(serde_json::Value::as_f64);
            let scaling: RopeScaling =
                serde_json::from_value(v.clone()).map_err(|e| format!("rope_parameters: {e}"))?;
            // A "default" rope type means no scaling at all.
            let scaling = Some(scaling).filter(|s| !matches!(s.kind(), None | Some("default")));
            Ok((theta, scaling))
        };
    match (v.get("full_attention"), v.get("sliding_attention")) {
        (None, None) => {
            let (theta, scaling) = one(v)?;
            Ok(RopeParams {
                theta,
                scaling,
                local_theta: None,
            })
        }
        (full, sliding) => {
            let (theta, scaling) = match full {
                Some(f) => one(f)?,
                None => (None, None),
            };
            let local_theta = match sliding {
                Some(s) => one(s)?.0,
                None => None,
            };
            Ok(RopeParams {
                theta,
                scaling,
                local_theta,
            })
        }
    }
}

impl TryFrom<serde_json::Value> for ModelConfig {
    type Error = String;

    /// A multimodal Gemma 3 config (`model_type` "gemma3") is read through its `text_config`.
    fn try_from(mut v: serde_json::Value) -> std::result::Result<Self, String> {
        let multimodal = v.get("model_type").and_then(|t| t.as_str()) == Some("gemma3")
            && v.get("text_config").is_some_and(|t| t.is_object());
        if multimodal {
            let mut text = v["text_config"].take();
            let obj = text.as_object_mut().expect("checked to be an object");
            obj.entry("model_type")
                .or_insert_with(|| serde_json::Value::from("gemma3_text"));
            for key in [
                "architectures",
                "bos_token_id",
                "eos_token_id",
                "torch_dtype",
                "dtype",
            ] {
                if let Some(x) = v.get(key)
                    && !obj.contains_key(key)
                {
                    obj.insert(key.to_string(), x.clone());
                }
            }
            v = text;
        }
        let raw: RawModelConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        ModelConfig::resolve(raw)
    }
}

impl ModelConfig {
    /// Resolves defaults, renamed fields and the family's switches.
    fn resolve(r: RawModelConfig) -> std::result::Result<ModelConfig, String> {
        let family = Family::of_model_type(&r.model_type);
        let gemma = family == Some(Family::Gemma3);
        let rp = rope_params(r.rope_parameters.as_ref())?;
        let layers = r.num_hidden_layers;
        let act_name = if gemma {
            r.hidden_activation.as_deref().or(r.hidden_act.as_deref())
        } else {
            r.hidden_act.as_deref().or(r.hidden_activation.as_deref())
        };
        let hidden_act = match act_name {
            Some(name) => Activation::parse(name).ok_or_else(|| {
                format!("hidden_act {name:?} is not supported (silu, gelu_pytorch_tanh)")
            })?,
            None if gemma => Activation::GeluTanh,
            None => Activation::Silu,
        };
        // Which layers slide, and over how many keys.
        let sliding_window = match family {
            Some(Family::Gemma3) => Some(r.sliding_window.unwrap_or(GEMMA3_SLIDING_WINDOW)),
            Some(Family::Qwen2 | Family::Qwen3) if r.use_sliding_window != Some(true) => None,
            _ => r.sliding_window,
        };
        let layer_types = match (&r.layer_types, sliding_window) {
            (Some(names), Some(_)) => names
                .iter()
                .map(|n| LayerType::parse(n).ok_or_else(|| format!("layer_types: unknown {n:?}")))
                .collect::<std::result::Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        let listed = !layer_types.is_empty() || sliding_window.is_none();
        let sliding_window_pattern = match family {
            Some(Family::Gemma3) if !listed => {
                Some(r.sliding_window_pattern.unwrap_or(GEMMA3_SLIDING_PATTERN))
            }
            _ if !listed => r.sliding_window_pattern,
            _ => None,
        };
        let max_window_layers = match family {
            Some(Family::Qwen2 | Family::Qwen3) if !listed => {
                Some(r.max_window_layers.unwrap_or(QWEN2_MAX_WINDOW_LAYERS))
            }
            _ if !listed => r.max_window_layers,
            _ => None,
        };
        let default_theta = if gemma {
            GEMMA3_ROPE_THETA
        } else {
            DEFAULT_ROPE_THETA
        };
        let head_dim = r.head_dim.or(match family {
            Some(Family::Gemma3) => Some(GEMMA3_HEAD_DIM),
            Some(Family::Qwen3) => Some(QWEN3_HEAD_DIM),
            _ => None,
        });
        Ok(ModelConfig {
            architectures: r.architectures,
            model_type: r.model_type,
            hidden_size: r.hidden_size,
            intermediate_size: r.intermediate_size,
            num_hidden_layers: layers,
            num_attention_heads: r.num_attention_heads,
            num_key_value_heads: r.num_key_value_heads.unwrap_or(r.num_attention_heads),
            head_dim,
            rms_norm_eps: r.rms_norm_eps.unwrap_or(DEFAULT_RMS_NORM_EPS),
            rope_theta: r.rope_theta.or(rp.theta).unwrap_or(default_theta),
            rope_scaling: r.rope_scaling.or(rp.scaling),
            vocab_size: r.vocab_size,
            max_position_embeddings: r.max_position_embeddings.unwrap_or(if gemma {
                GEMMA3_MAX_POSITIONS
            } else {
                DEFAULT_MAX_POSITION_EMBEDDINGS
            }),
            // transformers: Gemma 3 ties by default, Llama and Qwen do not.
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(gemma),
            bos_token_id: r.bos_token_id,
            eos_token_id: r.eos_token_id,
            torch_dtype: r.torch_dtype.or(r.dtype),
            attention_bias: r.attention_bias.unwrap_or(family == Some(Family::Qwen2)),
            qk_norm: r
                .qk_norm
                .unwrap_or(matches!(family, Some(Family::Qwen3 | Family::Gemma3))),
            norm_weight_offset: r
                .norm_weight_offset
                .unwrap_or(if gemma { 1.0 } else { 0.0 }),
            sandwich_norms: r.sandwich_norms.unwrap_or(gemma),
            hidden_act,
            embed_scale: r
                .embed_scale
                .or(gemma.then(|| (r.hidden_size as f64).sqrt())),
            query_pre_attn_scalar: r
                .query_pre_attn_scalar
                .or(gemma.then_some(GEMMA3_QUERY_PRE_ATTN_SCALAR)),
            attn_logit_softcapping: r.attn_logit_softcapping,
            final_logit_softcapping: r.final_logit_softcapping,
            use_sliding_window: sliding_window.is_some(),
            sliding_window,
            layer_types,
            sliding_window_pattern,
            max_window_layers,
            rope_local_base_freq: r
                .rope_local_base_freq
                .or(rp.local_theta)
                .or(gemma.then_some(GEMMA3_LOCAL_ROPE_THETA)),
        })
    }
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

    /// Reads and validates a HF `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| IoError::os(path, "read", e))?;
        Self::from_hf_json(path, &text)
    }

    /// Parses and validates the text of a HF `config.json`; `path` only names it in errors.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<ModelConfig> {
        let cfg: ModelConfig = serde_json::from_str(text).map_err(|source| IoError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Builds the config from GGUF metadata (`{arch}.*` keys) and validates it.
    ///
    /// Rope scaling: `{arch}.rope.scaling.*` keys are used when present. A `rope_freqs.weight`
    /// tensor (how llama.cpp stores Llama 3.x scaling) is matched against the llama3 formula with
    /// the Llama 3.x constants (low 1, high 4, original context 8192) and the factor taken from the
    /// tensor; if it does not match, `rope_type` is [`ROPE_TYPE_GGUF_FREQS`] and the model should
    /// read the divisors from the `gguf.rope_freqs.weight` tensor.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let arch = g.architecture()?.to_string();
        let key = |s: &str| format!("{arch}.{s}");
        let num_attention_heads = g.get_usize(&key("attention.head_count"))?;
        let head_dim = match g.opt_usize(&key("attention.key_length"))? {
            Some(d) => Some(d),
            None => g.opt_usize(&key("rope.dimension_count"))?,
        };
        let vocab_size = match g.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => match g.opt_str_array("tokenizer.ggml.tokens")? {
                Some(t) => t.len(),
                None => match g.tensor_info("token_embd.weight") {
                    Some(t) if t.ne.len() == 2 => t.ne[1] as usize,
                    _ => {
                        return Err(IoError::MissingMetadata {
                            path: g.path().to_path_buf(),
                            key: key("vocab_size"),
                        });
                    }
                },
            },
        };
        let model_type = match arch.as_str() {
            "gemma3" => "gemma3_text".to_string(),
            a => a.to_string(),
        };
        let family = Family::of_model_type(&model_type);
        let gemma = family == Some(Family::Gemma3);
        let rope_theta = g
            .opt_f32(&key("rope.freq_base"))?
            .map(decimal_f64)
            .unwrap_or(if gemma {
                GEMMA3_ROPE_THETA
            } else {
                DEFAULT_ROPE_THETA
            });
        let layers = g.get_usize(&key("block_count"))?;
        let hidden_size = g.get_usize(&key("embedding_length"))?;
        let opt_f64 = |k: &str| -> Result<Option<f64>> { Ok(g.opt_f32(&key(k))?.map(decimal_f64)) };
        // Gemma 3 in llama.cpp: every 6th layer global, the rest slide over
        // `attention.sliding_window` keys with RoPE base 10000 (no `rope_scaling`).
        let sliding_window = if gemma {
            g.opt_usize(&key("attention.sliding_window"))?
                .filter(|&w| w > 0)
        } else {
            None
        };
        let pattern = g
            .opt_usize(&key("attention.sliding_window_pattern"))
            .ok()
            .flatten()
            .unwrap_or(GEMMA3_SLIDING_PATTERN);
        // llama.cpp: Gemma 3 27B scales by hidden / heads, the others by head_dim.
        let query_pre_attn_scalar = gemma.then(|| {
            if layers == GEMMA3_27B_LAYERS {
                (hidden_size / num_attention_heads.max(1)) as f64
            } else {
                head_dim.unwrap_or(GEMMA3_HEAD_DIM) as f64
            }
        });
        let mut cfg = ModelConfig {
            architectures: hf_architectures(&arch),
            model_type,
            hidden_size,
            intermediate_size: g.get_usize(&key("feed_forward_length"))?,
            num_hidden_layers: layers,
            num_attention_heads,
            num_key_value_heads: g
                .opt_usize(&key("attention.head_count_kv"))?
                .unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: decimal_f64(g.get_f32(&key("attention.layer_norm_rms_epsilon"))?),
            rope_theta,
            rope_scaling: None,
            vocab_size,
            max_position_embeddings: g.get_usize(&key("context_length"))?,
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            bos_token_id: g.opt_u32("tokenizer.ggml.bos_token_id")?,
            eos_token_id: g.opt_u32("tokenizer.ggml.eos_token_id")?.map(EosIds::One),
            torch_dtype: None,
            // Biases are whatever the converter wrote (Qwen2 always has them).
            attention_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
            qk_norm: g.tensor_info("blk.0.attn_q_norm.weight").is_some(),
            // llama.cpp's converter folds Gemma's `1 + w` into the stored norm weights.
            norm_weight_offset: 0.0,
            sandwich_norms: gemma,
            hidden_act: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: gemma.then(|| (hidden_size as f64).sqrt()),
            query_pre_attn_scalar,
            attn_logit_softcapping: opt_f64("attn_logit_softcapping")?,
            final_logit_softcapping: opt_f64("final_logit_softcapping")?,
            use_sliding_window: sliding_window.is_some(),
            sliding_window,
            layer_types: Vec::new(),
            sliding_window_pattern: sliding_window.map(|_| pattern),
            max_window_layers: None,
            rope_local_base_freq: if gemma {
                Some(opt_f64("rope.freq_base_swa")?.unwrap_or(GEMMA3_LOCAL_ROPE_THETA))
            } else {
                None
            },
        };
        cfg.rope_scaling = gguf_rope_scaling(g, &arch, &cfg)?;
        cfg.validate(g.path())?;
        Ok(cfg)
    }

    /// Checks sizes are nonzero and head counts divide evenly; `path` names the source in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, expected: &str, found: String| IoError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            expected: expected.to_string(),
            found,
        };
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in nonzero {
            if v == 0 {
                return Err(bad(field, "a positive size", v.to_string()));
            }
        }
        match self.head_dim {
            Some(0) => return Err(bad("head_dim", "a positive size", "0".into())),
            Some(_) => {}
            None if !self.hidden_size.is_multiple_of(self.num_attention_heads) => {
                return Err(bad(
                    "num_attention_heads",
                    &format!("a divisor of hidden_size {}", self.hidden_size),
                    self.num_attention_heads.to_string(),
                ));
            }
            None => {}
        }
        let products = [
            (
                "num_attention_heads",
                self.num_attention_heads,
                "head_dim",
                self.head_dim(),
            ),
            (
                "num_key_value_heads",
                self.num_key_value_heads,
                "head_dim",
                self.head_dim(),
            ),
            (
                "vocab_size",
                self.vocab_size,
                "hidden_size",
                self.hidden_size,
            ),
            (
                "intermediate_size",
                self.intermediate_size,
                "hidden_size",
                self.hidden_size,
            ),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                "hidden_size",
                self.hidden_size,
            ),
        ];
        for (a, x, b, y) in products {
            if x.checked_mul(y)
                .and_then(|p| p.checked_mul(self.hidden_size.max(1)))
                .is_none()
            {
                return Err(bad(
                    a,
                    &format!(
                        "a size whose product with {b} {y} and hidden_size {} fits in usize",
                        self.hidden_size
                    ),
                    x.to_string(),
                ));
            }
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                "an even size (rotary embeddings rotate pairs)",
                self.head_dim().to_string(),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(bad(
                "num_key_value_heads",
                &format!(
                    "a divisor of num_attention_heads {}",
                    self.num_attention_heads
                ),
                self.num_key_value_heads.to_string(),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                "a positive finite number",
                self.rms_norm_eps.to_string(),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad(
                "rope_theta",
                "a positive finite number",
                self.rope_theta.to_string(),
            ));
        }
        let positive = [
            ("rope_local_base_freq", self.rope_local_base_freq),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("embed_scale", self.embed_scale),
        ];
        for (field, v) in positive {
            if let Some(x) = v
                && !(x.is_finite() && x > 0.0)
            {
                return Err(bad(field, "a positive finite number", x.to_string()));
            }
        }
        if !self.norm_weight_offset.is_finite() {
            return Err(bad(
                "norm_weight_offset",
                "a finite number",
                self.norm_weight_offset.to_string(),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(bad("sliding_window", "a positive size", "0".into()));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_hidden_layers {
            return Err(bad(
                "layer_types",
                &format!("one entry per layer ({}), or none", self.num_hidden_layers),
                self.layer_types.len().to_string(),
            ));
        }
        Ok(())
    }
}

/// GGUF stores floats as f32; going through the shortest decimal form recovers the value the
/// converter started from (1e-5, not 9.999999747e-6), so configs match their HF originals.
pub(crate) fn decimal_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

fn hf_architectures(arch: &str) -> Vec<String> {
    let name = match arch {
        "llama" => "LlamaForCausalLM",
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "gemma" => "GemmaForCausalLM",
        "gemma3" => "Gemma3ForCausalLM",
        "phi3" => "Phi3ForCausalLM",
        _ => return Vec::new(),
    };
    vec![name.to_string()]
}

fn gguf_rope_scaling(g: &GgufFile, arch: &str, cfg: &ModelConfig) -> Result<Option<RopeScaling>> {
    let key = |s: &str| format!("{arch}.{s}");
    if let Some(kind) = g.opt_str(&key("rope.scaling.type"))?
        && kind != "none"
    {
        return Ok(Some(RopeScaling {
            rope_type: Some(kind.to_string()),
            factor: g.opt_f32(&key("rope.scaling.factor"))?.map(decimal_f64),
            original_max_position_embeddings: g
                .opt_usize(&key("rope.scaling.original_context_length"))?,
            ..RopeScaling::default()
        }));
    }
    if g.tensor_info(ROPE_FREQS_TENSOR).is_none() {
        return Ok(None);
    }
    let freqs = g.dequantize(ROPE_FREQS_TENSOR)?;
    let factor = freqs.iter().fold(1.0f64, |m, &f| m.max(f64::from(f)));
    // head_dim comes from metadata: compare lengths before building head_dim / 2 divisors.
    let pairs_match = freqs.len() == cfg.head_dim() / 2;
    let llama3 = RopeScaling {
        rope_type: Some("llama3".into()),
        factor: Some(factor),
        low_freq_factor: Some(LLAMA3_LOW_FREQ_FACTOR),
        high_freq_factor: Some(LLAMA3_HIGH_FREQ_FACTOR),
        original_max_position_embeddings: Some(LLAMA3_ORIGINAL_CONTEXT),
        legacy_type: None,
    };
    let matches = pairs_match
        && llama3_rope_divisors(&llama3, cfg.rope_theta, cfg.head_dim())
            .iter()
            .zip(&freqs)
            .all(|(&e, &f)| (e - f64::from(f)).abs() <= ROPE_FREQS_TOLERANCE * e.abs());
    Ok(Some(if matches {
        llama3
    } else {
        RopeScaling {
            rope_type: Some(ROPE_TYPE_GGUF_FREQS.into()),
            factor: Some(factor),
            ..RopeScaling::default()
        }
    }))
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
