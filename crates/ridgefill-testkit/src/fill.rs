//! Skip-and-fill fixtures.

use ridgefill_model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill_model::{Decoder, FloatDType, to_host_f32};

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
