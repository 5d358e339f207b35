//! The model's RoPE set-up: long-context divisors from the config or the GGUF, the global and
//! the sliding layers' tables, and which one each layer rotates with.

use burn::tensor::{Device, FloatDType};
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::config::ModelConfig;

use super::Decoder;
use crate::error::{ModelError, Result};
use crate::rope::Rope;

/// GGUF name of llama.cpp's per-frequency RoPE divisors, as the checkpoint exposes it.
const GGUF_ROPE_FREQS: &str = "gguf.rope_freqs.weight";

/// Long-context RoPE divisors: Llama 3 scaling from the config, or a GGUF `rope_freqs` tensor.
pub(super) fn rope_divisors(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Option<Vec<f64>>> {
    let Some(sc) = cfg.rope_scaling.as_ref() else {
        return Ok(None);
    };
    match sc.kind() {
        Some("llama3") => Ok(Some(ridgefill_io::config::llama3_rope_divisors(
            sc,
            cfg.rope_theta,
            cfg.head_dim(),
        ))),
        Some("gguf_rope_freqs") => {
            let d = ckpt.tensor_f32(GGUF_ROPE_FREQS)?;
            Ok(Some(d.into_iter().map(f64::from).collect()))
        }
        Some("linear") => {
            let f = sc.factor.unwrap_or(1.0);
            Ok(Some(vec![f; cfg.head_dim() / 2]))
        }
        Some("default") | None => Ok(None),
        Some(other) => Err(ModelError::Invalid(format!(
            "{}: unsupported rope_scaling type {other:?} (supported: llama3, linear)",
            ckpt.path.display()
        ))),
    }
}

/// The model's RoPE tables: the global one (with `divisors`), and the local one of sliding
/// layers when the config gives them their own base.
pub(super) fn ropes(
    cfg: &ModelConfig,
    divisors: Option<&[f64]>,
    max_positions: usize,
    dtype: FloatDType,
    device: &Device,
) -> (Rope, Option<Rope>) {
    let hd = cfg.head_dim();
    let rope = Rope::new(hd, cfg.rope_theta, divisors, max_positions, dtype, device);
    let local = (0..cfg.num_hidden_layers)
        .any(|l| cfg.layer_uses_local_rope(l))
        .then(|| {
            let theta = cfg.rope_local_base_freq.unwrap_or(cfg.rope_theta);
            Rope::new(hd, theta, None, max_positions, dtype, device)
        });
    (rope, local)
}

impl Decoder {
    /// The RoPE tables layer `l` rotates with.
    pub fn rope_of(&self, l: usize) -> &Rope {
        match (&self.rope_local, self.layers[l].local_rope) {
            (Some(r), true) => r,
            _ => &self.rope,
        }
    }
}
