//! [`ModelConfig`] from GGUF metadata (`{arch}.*` keys), llama.cpp's names mapped onto HF's.

use super::*;

impl ModelConfig {
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
