//! Resolving, opening and loading a model onto a device.

use std::time::Instant;

use anyhow::Result;
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_model::LoadOptions;
use ridgefill_model::{Decoder, DeviceChoice, DeviceInfo, FloatDType, WeightFormat, select_device};

/// What to load and where.
#[derive(Clone, Debug)]
pub struct LoadArgs {
    pub model: String,
    pub device: DeviceChoice,
    pub dtype: FloatDType,
    pub weights: WeightFormat,
}

pub use ridgefill_model::dtype_name;

pub struct Loaded {
    pub ckpt: Checkpoint,
    pub model: Decoder,
    pub device: DeviceInfo,
    pub load_ms: f64,
}

/// Resolves, opens and loads the model onto the chosen device, with `max_positions` of RoPE.
pub fn load(args: &LoadArgs, max_positions: usize) -> Result<Loaded> {
    let t0 = Instant::now();
    let path = crate::resolve::model_path(&args.model)?;
    let ckpt = Checkpoint::open(&path)?;
    let device = select_device(args.device)?;
    if args.dtype != FloatDType::F32 && !device.device.supports_dtype(args.dtype) {
        anyhow::bail!(
            "device {} ({}) does not support {}",
            device.backend,
            device.adapter,
            dtype_name(args.dtype)
        );
    }
    let opts = LoadOptions {
        dtype: args.dtype,
        max_positions: max_positions.max(1),
        weights: args.weights,
    };
    // Every load error already names the file (and tensor): no "loading FILE:" prefix.
    let model = Decoder::load(&ckpt, &device.device, &opts)?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok(Loaded {
        ckpt,
        model,
        device,
        load_ms,
    })
}
