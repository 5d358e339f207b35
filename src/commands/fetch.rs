#[derive(clap::Args)]
pub struct Args {
    /// Manifest name (see models/*.toml), e.g. smollm2-135m.
    pub name: String,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let path = ridgefill::fetch::run(&a.name)?;
    println!("{}", path.display());
    Ok(())
}
