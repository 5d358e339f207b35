//! `ridgefill probe`: device ceilings (memory bandwidth, f32 FMA rate) measured with the WGSL
//! kernels in `shaders/` through raw wgpu, the yardstick `bench` reports against.

use anyhow::Result;
use ridgefill::model::DeviceChoice;

#[derive(clap::Args)]
pub struct Args {
    /// Devices, comma-separated: cpu (native kernels on flex's threads), wgpu (a real GPU when one
    /// exists, else the software adapter), vulkan, metal, cuda (through the same GPU's Vulkan adapter).
    #[arg(long, value_delimiter = ',', default_value = "cpu,wgpu")]
    pub device: Vec<DeviceChoice>,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    if !a.json {
        println!("| device | adapter | type | driver | bandwidth GB/s | f32 FMA GFLOP/s |");
        println!("|---|---|---|---|---:|---:|");
    }
    let threads = super::common::flex_threads();
    for choice in a.device {
        ridgefill::interrupt::check()?;
        let c = ridgefill::model::probe::probe(choice, threads)?;
        if a.json {
            let mut v = serde_json::to_value(&c)?;
            v["device"] = serde_json::Value::String(choice.to_string());
            println!("{v}");
        } else {
            println!(
                "| {choice} | {} | {} | {} | {:.1} | {:.1} |",
                c.adapter, c.device_type, c.driver, c.bandwidth_gbs, c.fma_gflops
            );
        }
    }
    Ok(())
}
