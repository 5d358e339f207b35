//! `ridgefill probe`: device ceilings measured with WGSL kernels through raw wgpu.

use anyhow::{Result, bail};

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> Result<()> {
    bail!("probe is not implemented yet")
}
