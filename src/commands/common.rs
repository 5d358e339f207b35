//! Flags and set-up shared by the model-running commands.

use ridgefill::model::{DeviceChoice, FloatDType, WeightFormat};
pub use ridgefill::session::load;

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// A .gguf file, a Hugging Face directory, or a manifest name (fetched when missing).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// auto | cpu | wgpu | vulkan | metal | cuda. `auto` takes a real GPU, else the CPU.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Weight and activation dtype: f32 | f16 | bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: FloatDType,
    /// How GGUF weights are held: native (their block formats, read by the quantised CPU
    /// kernels or packed for the GPU kernel) | f16 | q8 (Q8_0 at load, e.g. for Hugging Face checkpoints) |
    /// f32 (dequantised at load).
    #[arg(long, default_value = "native", value_parser = parse_weights)]
    pub weights: WeightFormat,
}

pub fn parse_weights(s: &str) -> std::result::Result<WeightFormat, String> {
    WeightFormat::parse(s)
        .ok_or_else(|| format!("unknown weight format {s:?} (expected native, f16, q8 or f32)"))
}

pub fn parse_dtype(s: &str) -> std::result::Result<FloatDType, String> {
    match s {
        "f32" => Ok(FloatDType::F32),
        "f16" => Ok(FloatDType::F16),
        "bf16" => Ok(FloatDType::BF16),
        other => Err(format!(
            "unknown dtype {other:?} (expected f32, f16 or bf16)"
        )),
    }
}

impl ModelArgs {
    pub fn load_args(&self) -> ridgefill::session::LoadArgs {
        ridgefill::session::LoadArgs {
            model: self.model.clone(),
            device: self.device,
            dtype: self.dtype,
            weights: self.weights,
        }
    }
}
