//! Device selection: `auto` takes a real GPU when one exists and otherwise the flex CPU backend.

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;

use crate::error::{ModelError, Result};

/// What the user asked for with `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Wgpu,
    Vulkan,
    Metal,
    Cuda,
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "cpu" | "flex" => Self::Cpu,
            "wgpu" => Self::Wgpu,
            "vulkan" => Self::Vulkan,
            "metal" => Self::Metal,
            "cuda" => Self::Cuda,
            other => {
                return Err(format!(
                    "unknown device {other:?} (expected auto, cpu, wgpu, vulkan, metal or cuda)"
                ));
            }
        })
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Wgpu => "wgpu",
            Self::Vulkan => "vulkan",
            Self::Metal => "metal",
            Self::Cuda => "cuda",
        };
        f.write_str(s)
    }
}

/// The device picked and a human-readable description of it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub device: Device,
    /// Backend name: `flex`, `wgpu`, `vulkan`, `metal`, `cuda`.
    pub backend: &'static str,
    /// Adapter / device name and driver, where known.
    pub adapter: String,
}

/// A wgpu adapter as the graphics API reports it.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    pub name: String,
    pub driver: String,
    pub backend: String,
    pub device_type: String,
    /// A real GPU (discrete or integrated), not a software rasteriser or CPU adapter.
    pub is_hardware: bool,
}

/// Lists wgpu adapters without creating a device (cheap; used by `auto` and `info`).
#[cfg(feature = "wgpu")]
pub fn wgpu_adapters() -> Vec<AdapterSummary> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        .map(|a| {
            let info = a.get_info();
            let is_hardware = matches!(
                info.device_type,
                wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu
            );
            AdapterSummary {
                name: info.name,
                driver: format!("{} {}", info.driver, info.driver_info)
                    .trim()
                    .to_string(),
                backend: format!("{:?}", info.backend),
                device_type: format!("{:?}", info.device_type),
                is_hardware,
            }
        })
        .collect()
}

#[cfg(not(feature = "wgpu"))]
pub fn wgpu_adapters() -> Vec<AdapterSummary> {
    Vec::new()
}

fn unavailable(choice: DeviceChoice) -> ModelError {
    ModelError::DeviceUnavailable(
        choice.to_string(),
        format!("this build has no `{choice}` feature; rebuild with `--features {choice}`"),
    )
}

#[cfg(feature = "wgpu")]
fn describe_wgpu(pred: impl Fn(&AdapterSummary) -> bool) -> String {
    wgpu_adapters()
        .into_iter()
        .find(pred)
        .map(|a| {
            format!(
                "{} ({}, {}, {})",
                a.name, a.backend, a.device_type, a.driver
            )
        })
        .unwrap_or_else(|| "default adapter".to_string())
}

/// Resolves a `--device` choice into a burn device.
pub fn select_device(choice: DeviceChoice) -> Result<DeviceInfo> {
    match choice {
        DeviceChoice::Auto => auto_device(),
        DeviceChoice::Cpu => cpu_device(),
        DeviceChoice::Wgpu => wgpu_device(),
        DeviceChoice::Vulkan => vulkan_device(),
        DeviceChoice::Metal => metal_device(),
        DeviceChoice::Cuda => cuda_device(),
    }
}

fn auto_device() -> Result<DeviceInfo> {
    #[cfg(feature = "cuda")]
    if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none_or(|v| !v.is_empty())
        && let Ok(info) = std::panic::catch_unwind(cuda_device)
        && let Ok(info) = info
    {
        return Ok(info);
    }
    #[cfg(feature = "wgpu")]
    {
        // Software adapters (lavapipe, llvmpipe) are slower than flex: never pick one here.
        if wgpu_adapters().iter().any(|a| a.is_hardware) {
            return wgpu_device();
        }
    }
    cpu_device()
}

fn cpu_device() -> Result<DeviceInfo> {
    #[cfg(feature = "flex")]
    {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(DeviceInfo {
            device: Device::flex(),
            backend: "flex",
            adapter: format!("CPU ({threads} threads)"),
        })
    }
    #[cfg(not(feature = "flex"))]
    Err(unavailable(DeviceChoice::Cpu))
}

fn wgpu_device() -> Result<DeviceInfo> {
    #[cfg(feature = "wgpu")]
    {
        let adapters = wgpu_adapters();
        if adapters.is_empty() {
            return Err(ModelError::DeviceUnavailable(
                "wgpu".into(),
                "no adapter found (install a GPU driver, or Mesa's lavapipe: mesa-vulkan-drivers)"
                    .into(),
            ));
        }
        // Prefer real hardware; fall back to whatever the API offers (e.g. lavapipe in CI).
        let adapter = describe_wgpu(|a| a.is_hardware);
        let adapter = if adapters.iter().any(|a| a.is_hardware) {
            adapter
        } else {
            describe_wgpu(|_| true)
        };
        Ok(DeviceInfo {
            device: Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            backend: "wgpu",
            adapter,
        })
    }
    #[cfg(not(feature = "wgpu"))]
    Err(unavailable(DeviceChoice::Wgpu))
}

fn vulkan_device() -> Result<DeviceInfo> {
    #[cfg(feature = "vulkan")]
    {
        Ok(DeviceInfo {
            device: Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
            backend: "vulkan",
            adapter: describe_wgpu(|a| a.backend == "Vulkan"),
        })
    }
    #[cfg(not(feature = "vulkan"))]
    Err(unavailable(DeviceChoice::Vulkan))
}

fn metal_device() -> Result<DeviceInfo> {
    #[cfg(feature = "metal")]
    {
        Ok(DeviceInfo {
            device: Device::metal(burn::tensor::DeviceKind::DefaultDevice),
            backend: "metal",
            adapter: describe_wgpu(|a| a.backend == "Metal"),
        })
    }
    #[cfg(not(feature = "metal"))]
    Err(unavailable(DeviceChoice::Metal))
}

fn cuda_device() -> Result<DeviceInfo> {
    #[cfg(feature = "cuda")]
    {
        let device = Device::cuda(0);
        let adapter = device
            .identity()
            .map(|i| i.name)
            .unwrap_or_else(|| "CUDA device 0".to_string());
        Ok(DeviceInfo {
            device,
            backend: "cuda",
            adapter,
        })
    }
    #[cfg(not(feature = "cuda"))]
    Err(unavailable(DeviceChoice::Cuda))
}

/// Whether `device` is the flex CPU backend (where the quantised CPU kernels run).
pub fn is_flex(device: &Device) -> bool {
    #[cfg(feature = "flex")]
    return matches!(device.as_dispatch(), burn::backend::DispatchDevice::Flex(_));
    #[cfg(not(feature = "flex"))]
    {
        let _ = device;
        false
    }
}
