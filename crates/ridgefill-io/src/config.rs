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

/// Architecture hyper-parameters (HF `config.json` field names).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(from = "RawModelConfig")]
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
}

/// transformers v5 moves rope settings into `rope_parameters`.
#[derive(Deserialize)]
struct RopeParameters {
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(flatten)]
    scaling: RopeScaling,
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
    rope_parameters: Option<RopeParameters>,
    vocab_size: usize,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<EosIds>,
    #[serde(default)]
    torch_dtype: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
}

impl From<RawModelConfig> for ModelConfig {
    fn from(r: RawModelConfig) -> Self {
        let (params_theta, params_scaling) = match r.rope_parameters {
            Some(p) => {
                // A "default" rope type in rope_parameters means no scaling at all.
                let scaling =
                    Some(p.scaling).filter(|s| !matches!(s.kind(), None | Some("default")));
                (p.rope_theta, scaling)
            }
            None => (None, None),
        };
        ModelConfig {
            architectures: r.architectures,
            model_type: r.model_type,
            hidden_size: r.hidden_size,
            intermediate_size: r.intermediate_size,
            num_hidden_layers: r.num_hidden_layers,
            num_attention_heads: r.num_attention_heads,
            num_key_value_heads: r.num_key_value_heads.unwrap_or(r.num_attention_heads),
            head_dim: r.head_dim,
            rms_norm_eps: r.rms_norm_eps.unwrap_or(DEFAULT_RMS_NORM_EPS),
            rope_theta: r.rope_theta.or(params_theta).unwrap_or(DEFAULT_ROPE_THETA),
            rope_scaling: r.rope_scaling.or(params_scaling),
            vocab_size: r.vocab_size,
            max_position_embeddings: r
                .max_position_embeddings
                .unwrap_or(DEFAULT_MAX_POSITION_EMBEDDINGS),
            tie_word_embeddings: r.tie_word_embeddings,
            bos_token_id: r.bos_token_id,
            eos_token_id: r.eos_token_id,
            torch_dtype: r.torch_dtype.or(r.dtype),
        }
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
        let rope_theta = g
            .opt_f32(&key("rope.freq_base"))?
            .map(decimal_f64)
            .unwrap_or(DEFAULT_ROPE_THETA);
        let mut cfg = ModelConfig {
            architectures: hf_architectures(&arch),
            model_type: arch.clone(),
            hidden_size: g.get_usize(&key("embedding_length"))?,
            intermediate_size: g.get_usize(&key("feed_forward_length"))?,
            num_hidden_layers: g.get_usize(&key("block_count"))?,
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
