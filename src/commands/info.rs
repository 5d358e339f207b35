//! `ridgefill info`: what a checkpoint holds; `--export-tokenizer` writes its tokenizer as a
//! Hugging Face tokenizer directory for tools that tokenize on their own (lm-evaluation-harness).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use ridgefill::io::checkpoint::Checkpoint;

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, a Hugging Face directory, or a manifest name (fetched when missing).
    #[arg(short = 'm', long = "model", default_value = ridgefill::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// Also list every tensor.
    #[arg(long)]
    pub tensors: bool,
    /// Write the tokenizer as a Hugging Face tokenizer directory (tokenizer.json,
    /// tokenizer_config.json with BOS/EOS and chat template, special_tokens_map.json).
    #[arg(long, value_name = "DIR")]
    pub export_tokenizer: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let path = ridgefill::resolve::model_path(&a.model)?;
    let ckpt = Checkpoint::open(&path)?;
    let c = &ckpt.config;
    println!("model:        {}", path.display());
    println!("format:       {:?}", ckpt.format);
    println!("architecture: {} {:?}", c.model_type, c.architectures);
    let family = c.family().map_or("unsupported", |f| f.name());
    let features = c.features();
    println!(
        "family:       {family} | {}",
        if features.is_empty() {
            "plain Llama blocks".to_string()
        } else {
            features.join(", ")
        }
    );
    println!(
        "shapes:       layers {} | hidden {} | ffn {} | heads {} | kv heads {} | head dim {} | vocab {}",
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim(),
        c.vocab_size
    );
    println!(
        "rope:         theta {} | scaling {:?} | context {}",
        c.rope_theta, c.rope_scaling, c.max_position_embeddings
    );
    println!(
        "norm eps:     {} | tied embeddings: {}",
        c.rms_norm_eps, c.tie_word_embeddings
    );
    let mut by_type: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut infos = Vec::new();
    for name in ckpt.tensor_names() {
        let info = ckpt.tensor_info(&name)?;
        let n: usize = info.shape.iter().product();
        let e = by_type.entry(info.dtype.clone()).or_default();
        e.0 += 1;
        e.1 += n;
        infos.push(info);
    }
    let total: usize = by_type.values().map(|v| v.1).sum();
    println!("parameters:   {total} ({:.1} M)", total as f64 / 1e6);
    for (ty, (count, n)) in &by_type {
        println!("  {ty:>6}: {count} tensors, {n} values");
    }
    let tok = &ckpt.tokenizer;
    println!(
        "tokenizer:    {} | vocab {} | bos {:?} | eos {:?}",
        tok.kind(),
        tok.vocab_size(),
        tok.bos_id(),
        tok.eos_ids()
    );
    match &ckpt.chat_template {
        Some(t) => {
            let src = t.source();
            println!("chat template: {} chars", src.len());
            for line in src.lines().take(12) {
                println!("  | {line}");
            }
        }
        None => println!("chat template: none"),
    }
    if a.tensors {
        for i in infos {
            println!("{:60} {:>6} {:?}", i.name, i.dtype, i.shape);
        }
    }
    if let Some(dir) = &a.export_tokenizer {
        let template = ckpt.chat_template.as_ref().map(|t| t.source());
        let files = ridgefill::io::tokenizer_export::export_hf(tok, template, dir)?;
        for f in files {
            println!("wrote:        {}", f.display());
        }
    }
    Ok(())
}
