//! Opens a checkpoint and converts every tensor to f32, reporting the time taken.
//!
//! `cargo run --release -p ridgefill-io --example dequant_all -- PATH`

use std::path::PathBuf;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .ok_or("usage: dequant_all PATH (a .gguf file or a HF model directory)")?;
    let t0 = Instant::now();
    let ckpt = ridgefill_io::Checkpoint::open(&path)?;
    let opened = t0.elapsed();
    let t1 = Instant::now();
    let mut elements = 0usize;
    let mut checksum = 0.0f64;
    for name in ckpt.tensor_names() {
        let v = ckpt.tensor_f32(&name)?;
        elements += v.len();
        checksum += v.iter().map(|&x| f64::from(x)).sum::<f64>();
    }
    let converted = t1.elapsed();
    let t2 = Instant::now();
    let fingerprint = ckpt.weights_fingerprint();
    let hashed = t2.elapsed();
    println!("open (config, tokenizer, template, checks): {opened:?}");
    println!(
        "tensor_f32 of {} tensors, {elements} elements: {converted:?} ({:.2} ns/element, checksum {checksum:.6e})",
        ckpt.tensor_names().len(),
        converted.as_nanos() as f64 / elements.max(1) as f64
    );
    println!("weights_fingerprint {fingerprint}: {hashed:?}");
    Ok(())
}
