//! Skip-and-fill fixtures.

use ridgefill_model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill_model::{Decoder, Device, FloatDType, to_host_f32};

/// Fill maps for every layer from `split` up, K's then V's, their values drawn from `next` in
/// row-major order: not the model's, just something to fill the cache with.
pub fn random_maps(m: &Decoder, split: usize, mut next: impl FnMut() -> f32) -> FillMaps {
    let c = &m.config;
    let rows = (c.hidden_size + 1) * c.kv_dim();
    let mut maps = || {
        (split..c.num_hidden_layers)
            .map(|_| (0..rows).map(|_| next()).collect())
            .collect::<Vec<Vec<f32>>>()
    };
    let (k, v) = (maps(), maps());
    FillMaps::from_host(
        split,
        c.hidden_size,
        c.kv_dim(),
        &k,
        &v,
        FloatDType::F32,
        &m.device,
    )
    .unwrap()
}

/// Last-position logits, on the host, of a skip-and-fill prefill of `ids` into a fresh cache.
pub fn fill_logits(m: &Decoder, ids: &[u32], maps: &FillMaps, rows: FillRows) -> Vec<f32> {
    let mut cache = m.new_cache(ids.len());
    let filled = Prefill::run(m, ids, &mut cache, FillOptions::fill(maps, rows)).unwrap();
    to_host_f32(filled.logits)
}

/// A random 64-wide Llama with grouped-query attention (4 heads over 2 KV heads), on flex, with
/// RidgeFill's fused CPU kernels or plain burn ops.
pub fn gqa_model(layers: usize, cpu_kernels: bool) -> Decoder {
    let mut m = gqa_model_on(layers, &Device::flex());
    m.set_cpu_kernels(cpu_kernels);
    m
}

/// [`gqa_model`]'s weights (the same seed) on `device`.
pub fn gqa_model_on(layers: usize, device: &Device) -> Decoder {
    let config: ridgefill_io::config::ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256,
        "max_position_embeddings": 1024, "tie_word_embeddings": true
    }))
    .unwrap();
    Decoder::random(config, device, FloatDType::F32, 512, 3).unwrap()
}

/// A precision matrix of the right shape (`I·1e-2`): the update's work, not a fitted one.
pub fn stand_in_precision(model: &Decoder) -> Vec<f32> {
    let f = model.config.hidden_size + 1;
    (0..f * f)
        .map(|i| if i % (f + 1) == 0 { 1e-2 } else { 0.0 })
        .collect()
}

/// Sink 1, the given tail, `exact` of the rows in spans of radius `span`.
pub fn spans_rows(tail: usize, exact: f64, span: usize) -> FillRows {
    FillRows {
        sink: 1,
        tail,
        exact,
        span,
        ..FillRows::default()
    }
}
