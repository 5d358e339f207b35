//! Loading a fill file for a model: every mismatch is an error before anything runs.

use std::path::Path;

use anyhow::Result;
use ridgefill_io::IoError;
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::fill::{FillFile, METADATA_KEY, ModelFingerprint, k_tensor_name, v_tensor_name};
use ridgefill_model::Llama;
use ridgefill_model::fill::FillMaps;

/// Reads `path`, checks it was made for this model and holds only finite numbers, and uploads
/// the maps to the model's device.
pub fn load_maps(path: &Path, ckpt: &Checkpoint, model: &Llama) -> Result<(FillFile, FillMaps)> {
    let file = FillFile::read(path)?;
    file.check_model(path, &ModelFingerprint::of(ckpt))?;
    let layers = model.num_layers();
    if file.meta.split == 0 || file.meta.split >= layers {
        return Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("{METADATA_KEY}.split"),
            expected: format!("0 < split < {layers} (this model's layers)"),
            found: file.meta.split.to_string(),
        }
        .into());
    }
    for (i, (k, v)) in file.k.iter().zip(&file.v).enumerate() {
        let layer = file.meta.split + i;
        for (tensor, m) in [(k_tensor_name(layer), k), (v_tensor_name(layer), v)] {
            if let Some(index) = m.iter().position(|x| !x.is_finite()) {
                return Err(IoError::NonFinite {
                    path: path.to_path_buf(),
                    tensor,
                    index,
                    value: f64::from(m[index]),
                }
                .into());
            }
        }
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
