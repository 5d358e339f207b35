use std::path::PathBuf;

use anyhow::Result;
use ridgefill::score::score_ids;

use super::common::{ModelArgs, load, read_text};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    pub text: PathBuf,
    /// Window length in tokens; windows do not overlap.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Replace undecodable bytes with U+FFFD instead of failing.
    #[arg(long)]
    pub lossy: bool,
}

pub fn run(a: Args) -> Result<()> {
    let text = read_text(&a.text, a.lossy)?;
    let loaded = load(&a.model.load_args(), a.ctx)?;
    let ids = loaded.ckpt.tokenizer.encode(&text, true)?;
    let r = score_ids(&loaded.model, &ids, a.ctx)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{}: {} tokens scored, mean NLL {:.6}, perplexity {:.4}",
            a.text.display(),
            r.tokens_scored,
            r.mean_nll,
            r.ppl
        );
    }
    Ok(())
}
