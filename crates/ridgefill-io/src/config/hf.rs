//! `config.json` as Hugging Face writes it: defaults, renamed fields and RoPE parameters resolved
//! into [`ModelConfig`].

use std::path::Path;

use serde::Deserialize;

use super::*;

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
}
