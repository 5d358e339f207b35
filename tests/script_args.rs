//! The scripts' bad arguments: each exits 2 with an error naming the argument, before anything is
//! installed, built or written (no venv, no results directory).

use std::path::Path;
use std::process::Command;

use ridgefill_testkit::repo;

/// Runs `scripts/lm_eval.sh` with `args` (results sent to `results`); returns its exit status and
/// stderr.
fn lm_eval(results: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new("bash")
        .arg(repo().join("scripts/lm_eval.sh"))
        .arg("--results")
        .arg(results)
        .args(args)
        // A venv path that must never be made: the checks come first.
        .env(
            "RIDGEFILL_LMEVAL_VENV",
            "/nonexistent/ridgefill-lmeval-venv",
        )
        .output()
        .expect("run bash");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lm_eval_rejects_bad_arguments_naming_them() {
    let rows: &[(&[&str], &str)] = &[
        (&["--limit", "0"], "--limit 0: expected a positive integer"),
        (
            &["--limit", "many"],
            "--limit many: expected a positive integer",
        ),
        (
            &["--lengths", "2k"],
            "--lengths 2k: expected comma-separated token counts",
        ),
        (
            &["--lengths", "2048,"],
            "--lengths 2048,: expected comma-separated token counts",
        ),
        (
            &["--parallel", "0"],
            "--parallel 0: expected a positive integer",
        ),
        (&["--tokenizer-from"], "--tokenizer-from needs a value"),
        (&["--fill"], "--fill needs a value"),
        (&["--frobnicate"], "unknown argument --frobnicate"),
    ];
    let dir = tempfile::tempdir().expect("temporary directory");
    let results = dir.path().join("results");
    for (args, needle) in rows {
        let (code, err) = lm_eval(&results, args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err}"
        );
        assert!(!err.contains("unbound variable"), "{args:?}: {err}");
        assert!(!results.exists(), "{args:?}: results directory made");
    }
}
