//! Bad command-line input: a clear message and a non-zero exit, never a panic. None of these
//! needs a model: they fail before one is loaded.

use std::process::Command;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .args(args)
        .output()
        .expect("run ridgefill");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    (out.status.code().unwrap_or(-1), stderr)
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad_utf8 = dir.path().join("latin1.txt");
    std::fs::write(&bad_utf8, b"caf\xe9 au lait").unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let missing = dir.path().join("nope.txt");
    let (bad_utf8, empty, missing) = (
        bad_utf8.to_str().unwrap(),
        empty.to_str().unwrap(),
        missing.to_str().unwrap(),
    );
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "-p", "x", "--device", "tpu"],
            "unknown device \"tpu\"",
        ),
        (
            &["generate", "-p", "x", "--dtype", "f8"],
            "unknown dtype \"f8\"",
        ),
        (
            &["generate", "-f", bad_utf8],
            "not valid UTF-8: invalid byte sequence at byte offset 3",
        ),
        (&["generate", "-f", empty], "empty prompt"),
        (&["generate", "-f", missing], "nope.txt: cannot read"),
        (&["generate"], "no prompt: give -p PROMPT or -f FILE"),
        (
            &["generate", "-p", "x", "-m", "no-such-model"],
            "unknown model \"no-such-model\"",
        ),
        (
            &["info", "-m", "missing/model.gguf"],
            "missing/model.gguf: no such file or directory",
        ),
        (
            &["fetch", "no-such-model"],
            "unknown model \"no-such-model\"",
        ),
        (
            &["score", "--text", bad_utf8],
            "not valid UTF-8: invalid byte sequence at byte offset 3",
        ),
        (
            &["fit", "--split", "15", "--alpha", "lots", "-o", "x.fill"],
            "--alpha \"lots\"",
        ),
        (
            &["fit", "--split", "15", "--dtype", "f8", "-o", "x.fill"],
            "--dtype \"f8\"",
        ),
        (&["fit", "--split", "15"], "nothing to write"),
        (
            &["eval", "--fill", "x.fill", "--text", empty, "--tail", "600"],
            "leaves no bulk rows",
        ),
        (&["generate", "-p", "x", "--fill", missing], "nope.txt"),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run(args);
        assert_ne!(code, 0, "{args:?} should fail");
        assert!(
            stderr.contains(needle),
            "{args:?}: expected {needle:?} in {stderr:?}"
        );
    }
}
