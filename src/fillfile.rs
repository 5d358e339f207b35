//! Loading a fill file for a model: every mismatch is an error before anything runs.

use std::path::Path;

use anyhow::{Result, bail};
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::fill::{FillFile, ModelFingerprint};
use ridgefill_model::Llama;
use ridgefill_model::fill::FillMaps;

/// Reads `path`, checks it was made for this model, and uploads the maps to the model's device.
pub fn load_maps(path: &Path, ckpt: &Checkpoint, model: &Llama) -> Result<(FillFile, FillMaps)> {
    let file = FillFile::read(path)?;
    file.check_model(path, &ModelFingerprint::of(ckpt))?;
    let layers = model.num_layers();
    if file.meta.split == 0 || file.meta.split >= layers {
        bail!(
            "{}: split {} is out of range for this {layers}-layer model",
            path.display(),
            file.meta.split
        );
    }
    let maps = FillMaps::from_host(
        file.meta.split,
        model.config.hidden_size,
        model.config.kv_dim(),
        &file.k,
        &file.v,
        model.dtype,
        &model.device,
    )?;
    Ok((file, maps))
}
