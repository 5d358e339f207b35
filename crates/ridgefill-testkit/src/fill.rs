//! Skip-and-fill fixtures.

use ridgefill_model::fill::FillMaps;
use ridgefill_model::{Decoder, FloatDType};

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
