//! GGUF <-> Hugging Face tensor names, and the shapes a config of a supported family implies.

use crate::config::ModelConfig;

/// Prefix given to GGUF tensors that have no HF counterpart (e.g. `gguf.rope_freqs.weight`).
pub const GGUF_ONLY_PREFIX: &str = "gguf.";
const GGUF_LAYER_PREFIX: &str = "blk.";
const HF_LAYER_PREFIX: &str = "model.layers.";

/// Whole-model tensors.
const GLOBAL: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// Per-layer tensors (after the layer index), llama.cpp's `tensor_mapping.py` names.
const PER_LAYER: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Gemma 2/3's sandwich norms: HF `post_attention_layernorm` is the norm on the attention
/// output (GGUF `post_attention_norm`), and the pre-MLP norm is `pre_feedforward_layernorm`
/// (GGUF `ffn_norm`); these override [`PER_LAYER`] for those architectures.
const PER_LAYER_GEMMA: &[(&str, &str)] = &[
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// GGUF architectures whose per-layer names follow [`PER_LAYER_GEMMA`].
const GEMMA_ARCHS: &[&str] = &["gemma2", "gemma3"];

/// The per-layer name table of a GGUF architecture: overrides first.
fn per_layer(arch: &str) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let over: &[(&str, &str)] = if GEMMA_ARCHS.contains(&arch) {
        PER_LAYER_GEMMA
    } else {
        &[]
    };
    over.iter().chain(
        PER_LAYER
            .iter()
            .filter(move |(g, h)| !over.iter().any(|(og, oh)| og == g || oh == h)),
    )
}

/// Parameter suffixes that map one to one.
const SUFFIXES: &[&str] = &["weight", "bias"];

/// Per-layer HF tensors every Llama-family layer must have.
pub const LAYER_TENSORS: &[&str] = &[
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

fn split_suffix(name: &str) -> Option<(&str, &str)> {
    let (stem, suffix) = name.rsplit_once('.')?;
    SUFFIXES.contains(&suffix).then_some((stem, suffix))
}

/// Splits "PREFIX{N}.rest" into (N, rest).
fn split_layer<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let (idx, rest) = rest.split_once('.')?;
    if idx.is_empty() || !idx.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((idx.parse().ok()?, rest))
}

/// HF name of a GGUF tensor of a Llama-architecture file; unknown tensors keep their name
/// under [`GGUF_ONLY_PREFIX`].
pub fn gguf_to_hf(name: &str) -> String {
    gguf_to_hf_arch("llama", name)
}

/// HF name of a GGUF tensor of architecture `arch` (`general.architecture`).
pub fn gguf_to_hf_arch(arch: &str, name: &str) -> String {
    let mapped = split_suffix(name).and_then(|(stem, suffix)| {
        if let Some((_, hf)) = GLOBAL.iter().find(|(g, _)| *g == stem) {
            return Some(format!("{hf}.{suffix}"));
        }
        let (layer, part) = split_layer(stem, GGUF_LAYER_PREFIX)?;
        let (_, hf) = per_layer(arch).find(|(g, _)| *g == part)?;
        Some(format!("{HF_LAYER_PREFIX}{layer}.{hf}.{suffix}"))
    });
    mapped.unwrap_or_else(|| format!("{GGUF_ONLY_PREFIX}{name}"))
}

/// GGUF name of a HF tensor, if it is one [`gguf_to_hf`] produces.
pub fn hf_to_gguf(name: &str) -> Option<String> {
    hf_to_gguf_arch("llama", name)
}

/// GGUF name of a HF tensor for architecture `arch`, if [`gguf_to_hf_arch`] produces it.
pub fn hf_to_gguf_arch(arch: &str, name: &str) -> Option<String> {
    if let Some(raw) = name.strip_prefix(GGUF_ONLY_PREFIX) {
        return Some(raw.to_string());
    }
    let (stem, suffix) = split_suffix(name)?;
    if let Some((g, _)) = GLOBAL.iter().find(|(_, h)| *h == stem) {
        return Some(format!("{g}.{suffix}"));
    }
    let (layer, part) = split_layer(stem, HF_LAYER_PREFIX)?;
    let (g, _) = per_layer(arch).find(|(_, h)| *h == part)?;
    Some(format!("{GGUF_LAYER_PREFIX}{layer}.{g}.{suffix}"))
}

/// The layer index of a `model.layers.N.*` name.
pub fn hf_layer_index(name: &str) -> Option<usize> {
    split_layer(name, HF_LAYER_PREFIX).map(|(i, _)| i)
}

/// The HF shape a Llama-family config implies for `name`, or `None` for tensors it says nothing about.
pub fn expected_shape(cfg: &ModelConfig, name: &str) -> Option<Vec<usize>> {
    let (h, inter, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    match name {
        "model.embed_tokens.weight" | "lm_head.weight" => return Some(vec![vocab, h]),
        "model.norm.weight" => return Some(vec![h]),
        _ => {}
    }
    let (_, part) = split_layer(name, HF_LAYER_PREFIX)?;
    Some(match part {
        "input_layernorm.weight"
        | "post_attention_layernorm.weight"
        | "pre_feedforward_layernorm.weight"
        | "post_feedforward_layernorm.weight"
        | "self_attn.o_proj.bias" => vec![h],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![cfg.head_dim()],
        "self_attn.q_proj.weight" => vec![q, h],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
        "self_attn.o_proj.weight" => vec![h, q],
        "self_attn.q_proj.bias" => vec![q],
        "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![inter, h],
        "mlp.down_proj.weight" => vec![h, inter],
        _ => return None,
    })
}

/// Per-layer HF tensors a config's switches add to [`LAYER_TENSORS`].
fn family_layer_tensors(cfg: &ModelConfig) -> Vec<&'static str> {
    let mut t = Vec::new();
    if cfg.attention_bias {
        t.extend([
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
        ]);
    }
    if cfg.qk_norm {
        t.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
    }
    if cfg.sandwich_norms {
        t.extend([
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
        ]);
    }
    t
}

/// HF names every checkpoint with this config must contain.
pub fn required_tensors(cfg: &ModelConfig) -> Vec<String> {
    required_tensors_iter(cfg).collect()
}

/// [`required_tensors`] lazily: `num_hidden_layers` comes from the file, so a caller looking
/// for the first missing tensor must not build the whole list first.
pub fn required_tensors_iter(cfg: &ModelConfig) -> impl Iterator<Item = String> + '_ {
    let globals = ["model.embed_tokens.weight", "model.norm.weight"]
        .into_iter()
        .chain((!cfg.tie_word_embeddings).then_some("lm_head.weight"))
        .map(str::to_string);
    let per_layer: Vec<&'static str> = LAYER_TENSORS
        .iter()
        .copied()
        .chain(family_layer_tensors(cfg))
        .collect();
    let layers = (0..cfg.num_hidden_layers).flat_map(move |layer| {
        per_layer
            .clone()
            .into_iter()
            .map(move |t| format!("{HF_LAYER_PREFIX}{layer}.{t}"))
    });
    globals.chain(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_names() {
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.12.attn_q.weight",
                "model.layers.12.self_attn.q_proj.weight",
            ),
            (
                "blk.0.ffn_norm.weight",
                "model.layers.0.post_attention_layernorm.weight",
            ),
            ("rope_freqs.weight", "gguf.rope_freqs.weight"),
            ("blk.x.attn_q.weight", "gguf.blk.x.attn_q.weight"),
        ] {
            assert_eq!(gguf_to_hf(g), h);
            assert_eq!(hf_to_gguf(h).as_deref(), Some(g));
        }
    }

    #[test]
    fn family_names() {
        for (arch, g, h) in [
            (
                "qwen2",
                "blk.3.attn_k.bias",
                "model.layers.3.self_attn.k_proj.bias",
            ),
            (
                "qwen3",
                "blk.0.attn_q_norm.weight",
                "model.layers.0.self_attn.q_norm.weight",
            ),
            (
                "qwen3",
                "blk.0.ffn_norm.weight",
                "model.layers.0.post_attention_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.1.ffn_norm.weight",
                "model.layers.1.pre_feedforward_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.1.post_attention_norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.1.post_ffw_norm.weight",
                "model.layers.1.post_feedforward_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.1.attn_k_norm.weight",
                "model.layers.1.self_attn.k_norm.weight",
            ),
            ("gemma3", "output_norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(gguf_to_hf_arch(arch, g), h, "{arch} {g}");
            assert_eq!(hf_to_gguf_arch(arch, h).as_deref(), Some(g), "{arch} {h}");
        }
    }
}
