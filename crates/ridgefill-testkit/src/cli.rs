//! The `ridgefill` binary, run end to end. Only the root package's tests know where it is
//! (`env!("CARGO_BIN_EXE_ridgefill")`), so they pass its path in.

use std::ffi::OsStr;
use std::process::Command;

/// Runs `bin` with `args` to completion, with kernel autotuning kept cheap (the tests check
/// values, not speed). Returns (success, stdout, stderr); a panic in the binary fails the test.
pub fn run(bin: impl AsRef<OsStr>, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin)
        .args(args)
        .env("CUBECL_AUTOTUNE_LEVEL", "minimal")
        .output()
        .expect("run ridgefill");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

/// `ridgefill fit` of `model` on the texts in `calib`, written to `out`: the small, quick fit
/// (CPU, split 1, 32-token windows, alpha 1e-3) that the CLI tests' fill files come from.
pub fn fit_args<'a>(model: &'a str, calib: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "fit", "-m", model, "--device", "cpu", "--calib", calib, "--split", "1", "--ctx", "32",
        "--alpha", "1e-3", "-o", out,
    ]
}
