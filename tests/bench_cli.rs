//! `ridgefill bench`, `probe` and `parity` end to end on the tiny model: the output formats carry
//! llama-bench's fields with consistent values, and the atomic `--out` file is complete.

mod common;

use std::path::Path;
use std::process::Command;

use common::ridgefill;
use ridgefill_testkit::{cli, tiny};

/// Repetitions in these runs (the sample vectors must have exactly this many entries).
const REPS: usize = 2;

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Each row's (test, mode).
fn test_modes(rows: &[serde_json::Value]) -> Vec<(&str, &str)> {
    rows.iter()
        .map(|r| (r["test"].as_str().unwrap(), r["mode"].as_str().unwrap()))
        .collect()
}

fn tiny_model(dir: &Path) -> String {
    let path = dir.join("tiny.gguf");
    tiny::write_gguf(&tiny::tiny(), &path, &tiny::Faults::default());
    path.to_str().unwrap().to_string()
}

#[test]
fn bench_json_has_llama_bench_fields_and_fill_speedups() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = dir.path().join("bench.json");
    let reps = REPS.to_string();
    let (ok, stdout, stderr) = ridgefill(&[
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "--split",
        "1",
        "--tail",
        "4",
        "-p",
        "24,48",
        "-n",
        "3",
        "-d",
        "16",
        "-r",
        &reps,
        "--no-probe",
        "-o",
        "json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.is_empty(), "--out writes the file, not stdout");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    // 2 prompt lengths + 1 decode test, each full and fill.
    assert_eq!(rows.len(), 6);
    let tests = test_modes(&rows);
    assert_eq!(
        tests,
        [
            ("pp24", "full"),
            ("pp24", "fill"),
            ("pp48", "full"),
            ("pp48", "fill"),
            ("tg3 @ d16", "full"),
            ("tg3 @ d16", "fill"),
        ]
    );
    for r in &rows {
        let samples_ts = r["samples_ts"].as_array().unwrap();
        let samples_ns = r["samples_ns"].as_array().unwrap();
        assert_eq!(samples_ts.len(), REPS);
        assert_eq!(samples_ns.len(), REPS);
        let tokens = (r["n_prompt"].as_u64().unwrap() + r["n_gen"].as_u64().unwrap()) as f64;
        // Every t/s sample is the test's tokens over the same sample's time.
        for (ts, ns) in samples_ts.iter().zip(samples_ns) {
            let from_ns = tokens / (ns.as_f64().unwrap() / 1e9);
            let ts = ts.as_f64().unwrap();
            assert!((ts - from_ns).abs() <= 1e-3 * ts, "{ts} vs {from_ns}");
        }
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
        assert_eq!(r["backend"], "flex");
        assert_eq!(r["n_layers"], tiny::LAYERS);
        assert!(r["burn_version"].as_str().unwrap().starts_with("0.22"));
        let fill = r["mode"] == "fill";
        assert_eq!(r["split"].is_null(), !fill);
        assert_eq!(r["speedup_vs_full"].is_null(), !fill);
        let pp = r["n_prompt"].as_u64().unwrap() > 0;
        assert_eq!(r["ttft_ms"].is_null(), !pp);
        if pp {
            let ttft = r["ttft_ms"].as_f64().unwrap();
            let avg_ms = r["avg_ns"].as_f64().unwrap() / 1e6;
            assert!((ttft - avg_ms).abs() <= 1e-6 * avg_ms);
        }
    }
    // Fill rows' speed-up is the mean of per-repetition ratios against the full rows.
    for pair in rows.chunks(2) {
        let (full, fill) = (
            floats(&pair[0]["samples_ts"]),
            floats(&pair[1]["samples_ts"]),
        );
        let want = fill.iter().zip(&full).map(|(a, b)| a / b).sum::<f64>() / REPS as f64;
        let got = pair[1]["speedup_vs_full"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    }
    // No temporary file is left next to the output.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn bench_csv_jsonl_and_markdown_agree_on_rows() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let base = [
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "-p",
        "16",
        "-n",
        "2",
        "-d",
        "4",
        "-r",
        "1",
        "--no-probe",
    ];
    let with = |fmt: &str| {
        let mut a = base.to_vec();
        a.extend(["-o", fmt]);
        let (ok, stdout, stderr) = ridgefill(&a);
        assert!(ok, "{stderr}");
        stdout
    };
    let csv = with("csv");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "header + pp16 + tg2:\n{csv}");
    let header: Vec<&str> = lines[0].split(',').collect();
    for field in [
        "n_prompt",
        "n_gen",
        "avg_ts",
        "stddev_ts",
        "avg_ns",
        "samples_ts",
        "mode",
    ] {
        assert!(header.contains(&field), "csv header lacks {field}");
    }
    let jsonl = with("jsonl");
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["test"], "pp16");
    assert_eq!(rows[1]["test"], "tg2 @ d4");
    let md = with("md");
    assert!(md.contains("| flex | full | pp16 |"), "{md}");
    assert!(md.contains("| flex | full | tg2 @ d4 |"), "{md}");
    assert!(md.contains("burn 0.22"), "{md}");
}

#[test]
fn bench_refuses_nonsense() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, "--device", "cpu", "-r", "0"]);
    assert!(!ok);
    assert!(stderr.contains("-r must be at least 1"), "{stderr}");
    let (ok, _, stderr) = ridgefill(&[
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "--split",
        "2",
        "-p",
        "16",
        "-n",
        "0",
        "--no-probe",
    ]);
    assert!(!ok);
    assert!(stderr.contains("split 2 is out of range"), "{stderr}");
    let (ok, _, stderr) = ridgefill(&["bench", "-m", "synthetic:gpt-17", "--device", "cpu"]);
    assert!(!ok);
    assert!(stderr.contains("unknown synthetic shape"), "{stderr}");
    let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, "-o", "xml"]);
    assert!(!ok);
    assert!(stderr.contains("invalid value 'xml'"), "{stderr}");
    // --resume-spans counts spans: bench's own flag and the fill flags serve and chat share.
    for cmd in ["bench", "serve", "chat"] {
        let (ok, _, stderr) = ridgefill(&[cmd, "-m", &model, "--resume-spans", "-1"]);
        assert!(!ok, "{cmd}");
        assert!(
            stderr.contains("unexpected argument '-1'"),
            "{cmd}: {stderr}"
        );
        let (ok, _, stderr) = ridgefill(&[cmd, "-m", &model, "--resume-spans", "two"]);
        assert!(!ok, "{cmd}");
        assert!(stderr.contains("invalid value 'two'"), "{cmd}: {stderr}");
    }
    let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, "-b", "4,0"]);
    assert!(!ok);
    assert!(stderr.contains("batch size of at least 1"), "{stderr}");
    let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, "-p", "0", "-n", "0"]);
    assert!(!ok);
    assert!(stderr.contains("nothing to measure"), "{stderr}");
    for (depth, want) in [
        ("deep", "expected a cached depth in tokens, found \"deep\""),
        ("512,0", "a depth of 0 is the plain ppN row"),
    ] {
        let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, "--pp-depth", depth]);
        assert!(!ok, "--pp-depth {depth}");
        assert!(stderr.contains(want), "{stderr}");
    }
    // The fill-method flags (the same parsers serve generate, eval and fit).
    for (flag, value, want) in [
        (
            "--method",
            "lasso",
            "expected ridge, spans or spans-adapt, found \"lasso\"",
        ),
        (
            "--exact",
            "1.5",
            "expected a share between 0 and 1, found \"1.5\"",
        ),
        (
            "--exact",
            "x",
            "expected a share between 0 and 1, found \"x\"",
        ),
    ] {
        let (ok, _, stderr) = ridgefill(&["bench", "-m", &model, flag, value]);
        assert!(!ok, "{flag} {value}");
        assert!(stderr.contains(want), "{flag} {value}: {stderr}");
    }
    let (ok, _, stderr) = ridgefill(&["generate", "-p", "x", "--adapt-weight", "0"]);
    assert!(!ok);
    assert!(
        stderr.contains("expected a positive number, found \"0\""),
        "{stderr}"
    );
    let (ok, _, stderr) = ridgefill(&["parity", "-m", &model, "--device", "cpu"]);
    assert!(!ok);
    assert!(
        stderr.contains("parity needs at least two devices"),
        "{stderr}"
    );
    let (ok, _, stderr) = ridgefill(&["probe", "--device", "tpu"]);
    assert!(!ok);
    assert!(stderr.contains("unknown device \"tpu\""), "{stderr}");
}

/// A run on a machine with no session (`XDG_RUNTIME_DIR` unset) that lists GPU adapters prints
/// nothing about Wayland: Mesa's device-select layer made libwayland complain on every run.
#[test]
fn a_headless_run_lists_adapters_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = Command::new(common::BIN)
        .args([
            "bench", "-m", &model, "--device", "auto", "-p", "8", "-n", "0", "-r", "1",
        ])
        .arg("--no-probe")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("NODEVICE_SELECT")
        .env("CUBECL_AUTOTUNE_LEVEL", "minimal")
        .output()
        .expect("run ridgefill");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("XDG_RUNTIME_DIR"), "{stderr}");
}

#[test]
fn probe_cpu_reports_positive_ceilings() {
    let (ok, stdout, stderr) = ridgefill(&["probe", "--device", "cpu", "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(v["bandwidth_gbs"].as_f64().unwrap() > 0.1, "{v}");
    assert!(v["fma_gflops"].as_f64().unwrap() > 0.1, "{v}");
}

#[test]
fn bench_with_a_fitted_fill_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let calib = dir.path().join("calib");
    std::fs::create_dir(&calib).unwrap();
    for i in 0..4 {
        std::fs::write(calib.join(format!("doc{i}.txt")), tiny::words(150, i + 1)).unwrap();
    }
    let fill = dir.path().join("tiny.fill");
    let (ok, _, stderr) = ridgefill(&cli::fit_args(
        &model,
        calib.to_str().unwrap(),
        fill.to_str().unwrap(),
    ));
    assert!(ok, "fit: {stderr}");
    let (ok, stdout, stderr) = ridgefill(&[
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "--fill",
        fill.to_str().unwrap(),
        "--tail",
        "4",
        "-p",
        "32",
        "--pp-depth",
        "40",
        "-n",
        "0",
        "-r",
        "1",
        "--no-probe",
        "-o",
        "jsonl",
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tests = test_modes(&rows);
    assert_eq!(
        tests,
        [
            ("pp32", "full"),
            ("pp32", "fill"),
            ("pp32 @ d40", "full"),
            ("pp32 @ d40", "fill"),
        ]
    );
    // A prefill over a cached context holds the context's rows too.
    for (r, positions) in [(&rows[2], 72), (&rows[3], 72), (&rows[0], 32)] {
        assert_eq!(r["n_depth"], if positions == 72 { 40 } else { 0 });
        let per = rows[0]["kv_bytes"].as_u64().unwrap() / 32;
        assert_eq!(r["kv_bytes"].as_u64().unwrap(), per * positions);
        assert!(r["gflops"].as_f64().unwrap() > 0.0, "{r}");
    }
    // `fit` records the shipped method; `bench` runs what the file records.
    assert_eq!(rows[1]["fill_maps"], "fitted spans-adapt");
    assert_eq!(rows[1]["split"], 1);
    assert_eq!(rows[1]["n_tail"], 4);
    // A fill file belongs to one checkpoint: random-weight models cannot use it.
    let (ok, _, stderr) = ridgefill(&[
        "bench",
        "-m",
        "synthetic:smollm2-135m",
        "--device",
        "cpu",
        "--fill",
        fill.to_str().unwrap(),
        "-p",
        "32",
        "-n",
        "0",
        "--no-probe",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--fill needs a real checkpoint"),
        "{stderr}"
    );
}

/// `-b` adds batched rows: aggregate t/s of several prompts prefilled together and of several
/// sequences decoded in one step each, with the KV bytes of all of them, next to the
/// single-sequence rows.
#[test]
fn bench_batch_rows_report_aggregate_prefill_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (ok, stdout, stderr) = ridgefill(&[
        "bench",
        "-m",
        &model,
        "--device",
        "cpu",
        "-p",
        "5",
        "-n",
        "3",
        "-d",
        "8",
        "-b",
        "1,3",
        "-r",
        "1",
        "--no-probe",
        "-o",
        "jsonl",
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tests: Vec<&str> = rows.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp5", "pp5 x b3", "tg3 @ d8", "tg3 @ d8 x b3"]);
    for r in &rows {
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0, "{r}");
    }
    let kv = |i: usize| rows[i]["kv_bytes"].as_u64().unwrap();
    assert_eq!(kv(1), 3 * kv(0), "a batch row holds every prompt's cache");
    assert_eq!(kv(3), 3 * kv(2), "a batch row holds every sequence's cache");
}
