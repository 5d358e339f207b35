//! `ridgefill` command-line interface.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod commands;

#[derive(Parser)]
#[command(
    name = "ridgefill",
    version,
    about = "Fast LLM prefill with ridge-fitted KV fill"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a model named by a manifest in models/ (idempotent, checksum-verified).
    Fetch(commands::fetch::Args),
    /// Generate text, streaming it to stdout; timings go to stderr.
    Generate(commands::generate::Args),
    /// Teacher-forced negative log-likelihood of a text file.
    Score(commands::score::Args),
    /// Prefill and decode speed, llama-bench style (warm-up, repetitions, mean ± std).
    Bench(commands::bench::Args),
    /// Fit skip-and-fill maps by ridge regression over calibration text; write a fill file.
    Fit(commands::fit::Args),
    /// Fidelity of skip-and-fill against full prefill, drop and own-projection baselines.
    Eval(commands::eval::Args),
    /// Measure the device's own ceilings (memory bandwidth, f32 FMA rate) with WGSL kernels.
    Probe(commands::probe::Args),
    /// Compare logits of the same model across devices (the first is the reference).
    Parity(commands::parity::Args),
    /// Describe a model: architecture, shapes, dtypes, tokenizer, chat template.
    Info(commands::info::Args),
    /// Interactive chat in the terminal with the model's chat template, streaming replies.
    Chat(commands::chat::Args),
    /// OpenAI-compatible HTTP server with continuous batching (chat and text completions).
    Serve(commands::serve::Args),
}

/// Mesa's Vulkan device-select layer connects to Wayland while wgpu lists adapters, and on a
/// machine with no session (`XDG_RUNTIME_DIR` unset) libwayland prints "error: XDG_RUNTIME_DIR is
/// invalid or not set" on every run. With no display to choose a GPU by, the layer has nothing to
/// do there, so it is switched off (`NODEVICE_SELECT`, Mesa's own switch) unless the user set it.
fn quiet_headless_vulkan() {
    let unset = |name| std::env::var_os(name).is_none_or(|v| v.is_empty());
    if unset("XDG_RUNTIME_DIR") && unset("NODEVICE_SELECT") {
        // SAFETY: called first thing in main, before any thread exists to read the environment.
        unsafe { std::env::set_var("NODEVICE_SELECT", "1") };
    }
}

fn main() -> ExitCode {
    // A closed stdout pipe (`| head`) ends the process as it does other Unix tools, instead of
    // `println!` panicking on EPIPE.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    quiet_headless_vulkan();
    let cli = Cli::parse();
    ridgefill::interrupt::install();
    let result = match cli.command {
        Command::Fetch(a) => commands::fetch::run(a),
        Command::Generate(a) => commands::generate::run(a),
        Command::Score(a) => commands::score::run(a),
        Command::Info(a) => commands::info::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Fit(a) => commands::fit::run(a),
        Command::Eval(a) => commands::eval::run(a),
        Command::Probe(a) => commands::probe::run(a),
        Command::Parity(a) => commands::parity::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Chat(a) => commands::chat::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<ridgefill::interrupt::Interrupted>() => {
            ridgefill::interrupt::restore_terminal();
            eprintln!("{e}");
            ExitCode::from(ridgefill::interrupt::EXIT_INTERRUPTED)
        }
        Err(e) => {
            eprintln!("error: {}", message(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each cause once: typed errors often quote their source already.
fn message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}
