//! GPU ceilings through raw wgpu with the WGSL kernels in `shaders/`.

use std::time::Instant;

use super::Ceilings;
use crate::device::DeviceChoice;
use crate::error::{ModelError, Result};

/// The copy kernel: bytes moved = 2 × buffer size.
pub const BANDWIDTH_WGSL: &str = include_str!("../../../../shaders/bandwidth.wgsl");
/// The FMA kernel.
pub const FMA_WGSL: &str = include_str!("../../../../shaders/fma.wgsl");

/// Must match `@workgroup_size` in both shaders.
const WORKGROUP: u32 = 256;
/// Must match `ITERS` in `fma.wgsl`.
const FMA_ITERS: u64 = 512;
/// Independent vec4 accumulators in `fma.wgsl`.
const FMA_ACCS: u64 = 8;
/// FLOPs of one FMA on one lane.
const FLOPS_PER_FMA: u64 = 2;
/// Lanes in a vec4.
const LANES: u64 = 4;
/// Copy buffer size: far beyond any last-level cache, within every adapter's default
/// 128 MiB storage-binding limit.
const COPY_BYTES: u64 = 128 << 20;
/// Workgroups for the copy (grid-stride loop); enough to fill any current GPU.
const COPY_GROUPS: u32 = 4096;
/// Upper bound on FMA workgroups: enough to fill any current GPU many times over.
const FMA_GROUPS: u32 = 8192;
/// Workgroups of the sizing run that scales the FMA grid to the device's speed.
const FMA_PILOT_GROUPS: u32 = 64;
/// Target seconds per FMA dispatch: long enough to time, short enough on a CPU adapter.
const FMA_TARGET_S: f64 = 0.05;

fn err(what: impl std::fmt::Display) -> ModelError {
    ModelError::DeviceUnavailable("probe".into(), what.to_string())
}

/// Picks the adapter a `--device` choice would run on: `cpu` → the software adapter (lavapipe),
/// whose ceilings approximate the CPU's; others → the first matching real GPU, else any.
fn pick_adapter(choice: DeviceChoice) -> Result<wgpu::Adapter> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    let hardware = |a: &wgpu::Adapter| {
        matches!(
            a.get_info().device_type,
            wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu
        )
    };
    let backend_is = |b: wgpu::Backend| move |a: &wgpu::Adapter| a.get_info().backend == b;
    let found = match choice {
        DeviceChoice::Cpu => adapters.into_iter().find(|a| {
            matches!(
                a.get_info().device_type,
                wgpu::DeviceType::Cpu | wgpu::DeviceType::VirtualGpu
            )
        }),
        DeviceChoice::Vulkan | DeviceChoice::Cuda => {
            let vk = backend_is(wgpu::Backend::Vulkan);
            let first_hw = adapters.iter().position(|a| vk(a) && hardware(a));
            let first = first_hw.or_else(|| adapters.iter().position(vk));
            first.map(|i| adapters.into_iter().nth(i).expect("index from position"))
        }
        DeviceChoice::Metal => adapters.into_iter().find(backend_is(wgpu::Backend::Metal)),
        DeviceChoice::Auto | DeviceChoice::Wgpu => {
            let first_hw = adapters.iter().position(hardware);
            let i = first_hw.or(if adapters.is_empty() { None } else { Some(0) });
            i.map(|i| adapters.into_iter().nth(i).expect("index from position"))
        }
    };
    found.ok_or_else(|| err(format!("no wgpu adapter for `{choice}`")))
}

struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
}

impl Gpu {
    fn pipeline(&self, wgsl: &str, label: &str) -> wgpu::ComputePipeline {
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(wgsl.into()),
            });
        self.device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
    }

    fn storage(&self, bytes: u64, label: &str) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    }

    /// Runs `dispatches` back-to-back dispatches and waits for them; returns seconds.
    fn time(
        &self,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        groups: u32,
        dispatches: u32,
    ) -> Result<f64> {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, group, &[]);
            for _ in 0..dispatches {
                pass.dispatch_workgroups(groups, 1, 1);
            }
        }
        let t = Instant::now();
        self.queue.submit([enc.finish()]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(err)?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Best time of `reps` runs after one warm-up (the warm-up also compiles the pipeline).
    fn best(
        &self,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        groups: u32,
        dispatches: u32,
        reps: usize,
    ) -> Result<f64> {
        self.time(pipeline, group, groups, 1)?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            best =
                best.min(self.time(pipeline, group, groups, dispatches)? / f64::from(dispatches));
        }
        Ok(best)
    }
}

/// Timed runs per kernel; the best is reported (a ceiling, not a typical value).
const PROBE_REPS: usize = 5;
/// Dispatches per timed run, so submit overhead is amortised.
const DISPATCHES: u32 = 4;

/// Measures the ceilings of the adapter a `--device` choice maps to (a few seconds).
pub fn probe_wgpu(choice: DeviceChoice) -> Result<Ceilings> {
    let adapter = pick_adapter(choice)?;
    let info = adapter.get_info();
    let limits = adapter.limits();
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("ridgefill-probe"),
        required_limits: limits.clone(),
        ..Default::default()
    }))
    .map_err(err)?;
    let gpu = Gpu { device, queue };

    let copy_bytes = COPY_BYTES
        .min(limits.max_storage_buffer_binding_size)
        .min(limits.max_buffer_size)
        / 16
        * 16;
    let copy = gpu.pipeline(BANDWIDTH_WGSL, "bandwidth");
    let src = gpu.storage(copy_bytes, "src");
    let dst = gpu.storage(copy_bytes, "dst");
    let copy_group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &copy.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: src.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: dst.as_entire_binding(),
            },
        ],
    });
    let copy_groups = COPY_GROUPS.min(limits.max_compute_workgroups_per_dimension);
    let t = gpu.best(&copy, &copy_group, copy_groups, DISPATCHES, PROBE_REPS)?;
    let bandwidth_gbs = 2.0 * copy_bytes as f64 / t / 1e9;

    let fma = gpu.pipeline(FMA_WGSL, "fma");
    let max_groups = FMA_GROUPS.min(limits.max_compute_workgroups_per_dimension);
    let sink = gpu.storage(u64::from(max_groups) * u64::from(WORKGROUP) * 16, "sink");
    let fma_group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &fma.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: sink.as_entire_binding(),
        }],
    });
    let pilot = FMA_PILOT_GROUPS.min(max_groups);
    let t_pilot = gpu.best(&fma, &fma_group, pilot, 1, 1)?;
    let scale = (FMA_TARGET_S / t_pilot.max(1e-9)).max(1.0);
    let groups = ((f64::from(pilot) * scale) as u32).clamp(pilot, max_groups);
    let invocations = u64::from(groups) * u64::from(WORKGROUP);
    let t = gpu.best(&fma, &fma_group, groups, DISPATCHES, PROBE_REPS)?;
    let flops = invocations * FMA_ITERS * FMA_ACCS * LANES * FLOPS_PER_FMA;
    let fma_gflops = flops as f64 / t / 1e9;

    Ok(Ceilings {
        adapter: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        bandwidth_gbs,
        fma_gflops,
    })
}
