//! Calibration and ridge fit on the tiny random Llama (no network): the fit recovers what is
//! exactly linear, shards merge to one pass, and fill files round-trip into the engine.

mod common;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::io::fill::{FillDtype, ModelFingerprint, SplitTrial};
use ridgefill::io::stats::{Moments, StatsFile};
use ridgefill::io::text::Document;
use ridgefill::model::fill::{FillMaps, FillMethod, FillOptions, FillRows, Prefill};
use ridgefill::model::{Device, to_host_f32};
use ridgefill_fit::FitError;
use ridgefill_fit::calibrate::{
    CalibConfig, Control, accumulate_window, accumulate_window_splits, calibrate,
    calibrate_splits_with,
};
use ridgefill_fit::{
    AlphaChoice, FitOptions, SplitBudget, default_split_candidates, fit_fill,
    fit_fill_split_search, ridge_solve,
};
use ridgefill_testkit::tiny;

const SPLIT: usize = 1;

fn docs(n: usize, seed: u64) -> Vec<Document> {
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", ".",
    ];
    let mut rng = tiny::Rng::new(seed);
    (0..n)
        .map(|i| {
            let text: Vec<&str> = (0..120)
                .map(|_| words[((rng.next_f32() + 1.0) * 6.0) as usize % words.len()])
                .collect();
            Document {
                source: format!("doc{i}"),
                text: text.join(" "),
            }
        })
        .collect()
}

fn checkpoint(dir: &tempfile::TempDir) -> Checkpoint {
    let t = tiny::tiny();
    let path = dir.path().join("tiny.gguf");
    tiny::write_gguf(&t, &path, &tiny::Faults::default());
    Checkpoint::open(&path).unwrap()
}

/// Layers of the deeper tiny model the split search runs on.
const DEEP_LAYERS: usize = 4;

/// The tiny model with [`DEEP_LAYERS`] layers: the extra layers are the first ones again, with
/// every exactly negatable tensor (all but the Q8_0 ones) negated so they differ.
fn deep_checkpoint(dir: &tempfile::TempDir) -> (Checkpoint, std::path::PathBuf) {
    let mut t = tiny::tiny();
    let mut extra = Vec::new();
    for l in tiny::LAYERS..DEEP_LAYERS {
        let from = l % tiny::LAYERS;
        let (hf, gg) = (format!("model.layers.{from}."), format!("blk.{from}."));
        for tt in t.tensors.iter().filter(|tt| tt.hf_name.starts_with(&hf)) {
            let negate = tt.gguf_store != tiny::Store::Q8_0;
            extra.push(tiny::TinyTensor {
                hf_name: tt.hf_name.replacen(&hf, &format!("model.layers.{l}."), 1),
                gguf_name: tt.gguf_name.replacen(&gg, &format!("blk.{l}."), 1),
                hf_shape: tt.hf_shape.clone(),
                values: if negate {
                    tt.values.iter().map(|v| -v).collect()
                } else {
                    tt.values.clone()
                },
                hf_store: tt.hf_store,
                gguf_store: tt.gguf_store,
                q8_raw: tt.q8_raw.clone(),
                permute_heads: tt.permute_heads,
            });
        }
    }
    t.tensors.extend(extra);
    let path = dir.path().join("deep.gguf");
    let mut w = tiny::gguf_writer(&t, &tiny::Faults::default());
    w.add_meta("llama.block_count", DEEP_LAYERS as u32);
    w.write(&path).unwrap();
    (Checkpoint::open(&path).unwrap(), path)
}

fn cfg(max_tokens: Option<usize>) -> CalibConfig {
    CalibConfig {
        split: SPLIT,
        sink: 1,
        ctx: 32,
        max_tokens,
        heldout_fraction: 0.2,
    }
}

#[test]
fn fit_recovers_the_split_layers_own_projection() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(&dir);
    let model = common::load_on(&ck, &Device::flex());
    let cal = calibrate(
        &model,
        ModelFingerprint::of(&ck),
        &ck.tokenizer,
        &docs(30, 1),
        &cfg(None),
        &mut |_| {},
    )
    .unwrap();
    assert!(cal.stats.fit.rows > 500 && cal.stats.heldout.rows > 0);
    let opts = FitOptions {
        alpha: AlphaChoice::Fixed(1e-9),
        rows: FillRows {
            sink: 1,
            tail: 4,
            ..FillRows::default()
        },
        method: FillMethod::Ridge,
        adapt_weight: 0.0,
        created_by: "test".into(),
    };
    let file = fit_fill(&model, &cal.stats, &cal.heldout_windows, &opts).unwrap();
    // Layer `split` reads h_split through its own norm: its K/V are exactly linear in the features.
    let q = &file.meta.quality[0];
    assert_eq!(q.layer, SPLIT);
    assert!(q.r2_k > 0.9999 && q.r2_v > 0.9999, "{q:?}");
    let own = to_host_f32(FillMaps::own_proj(&model, SPLIT).unwrap().w);
    let kv = model.config.kv_dim();
    let cols = 2 * kv;
    for r in 0..=model.config.hidden_size {
        for c in 0..kv {
            let (want_k, want_v) = (own[r * cols + c], own[r * cols + kv + c]);
            let (k, v) = (file.k[0][r * kv + c], file.v[0][r * kv + c]);
            assert!(
                (k - want_k).abs() < 1e-2 * (1.0 + want_k.abs()),
                "k[{r},{c}] {k} vs {want_k}"
            );
            assert!(
                (v - want_v).abs() < 1e-2 * (1.0 + want_v.abs()),
                "v[{r},{c}] {v} vs {want_v}"
            );
        }
    }
    // The written file loads back into the engine and runs.
    let path = dir.path().join("tiny.fill");
    file.write(&path, FillDtype::F32).unwrap();
    let (_, maps) = ridgefill::fillfile::load_maps(&path, &ck, &model).unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 5 + 3) % 200).collect();
    let logits = Prefill::run(
        &model,
        &ids,
        &mut model.new_cache(20),
        FillOptions::fill(
            &maps,
            FillRows {
                sink: 1,
                tail: 4,
                ..FillRows::default()
            },
        ),
    )
    .map(|f| f.logits)
    .unwrap();
    assert!(to_host_f32(logits).iter().all(|x| x.is_finite()));
}

#[test]
fn merged_shards_equal_one_pass_over_the_union() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(&dir);
    let model = common::load_on(&ck, &Device::flex());
    let all = docs(8, 7);
    let tok = &ck.tokenizer;
    let windows: Vec<Vec<u32>> = all
        .iter()
        .flat_map(|d| {
            tok.encode(&d.text, true)
                .unwrap()
                .chunks(32)
                .map(<[u32]>::to_vec)
                .collect::<Vec<_>>()
        })
        .filter(|w| w.len() > 3)
        .collect();
    let (f, cols) = (
        model.config.hidden_size + 1,
        (model.num_layers() - SPLIT) * 2 * model.config.kv_dim(),
    );
    let mut union = Moments::zeros(f, cols);
    for w in &windows {
        accumulate_window(&model, w, SPLIT, 1, &mut union).unwrap();
    }
    let base = calibrate(
        &model,
        ModelFingerprint::of(&ck),
        tok,
        &all[..1],
        &cfg(Some(1)),
        &mut |_| {},
    )
    .unwrap()
    .stats;
    let half = windows.len() / 2;
    let mut paths = Vec::new();
    for (i, part) in [&windows[..half], &windows[half..]].into_iter().enumerate() {
        let mut fit = Moments::zeros(f, cols);
        for w in part {
            accumulate_window(&model, w, SPLIT, 1, &mut fit).unwrap();
        }
        let shard = StatsFile {
            meta: base.meta.clone(),
            fit,
            heldout: Moments::zeros(f, cols),
        };
        let p = dir.path().join(format!("shard{i}.stats"));
        shard.write(&p).unwrap();
        paths.push(p);
    }
    let merged = StatsFile::merge(&paths).unwrap();
    assert_eq!(merged.fit.rows, union.rows);
    let close = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-9 * (1.0 + x.abs().max(y.abs())))
    };
    assert!(close(&merged.fit.xtx, &union.xtx));
    assert!(close(&merged.fit.xty, &union.xty));
    assert!(close(&merged.fit.y_sq, &union.y_sq));
    let (wa, _) = ridge_solve(&merged.fit, 1e-3).unwrap();
    let (wb, _) = ridge_solve(&union, 1e-3).unwrap();
    for j in 0..wa.ncols() {
        for i in 0..wa.nrows() {
            assert!((wa[(i, j)] - wb[(i, j)]).abs() < 1e-8 * (1.0 + wb[(i, j)].abs()));
        }
    }
}

#[test]
fn too_few_tokens_says_how_many_are_needed() {
    let m = Moments::zeros(65, 8);
    let err = ridge_solve(&m, 1e-3).unwrap_err().to_string();
    assert!(
        err.contains("too few calibration tokens") && err.contains("need at least 130"),
        "{err}"
    );
}

#[test]
fn a_fill_file_for_another_model_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(&dir);
    let model = common::load_on(&ck, &Device::flex());
    let cal = calibrate(
        &model,
        ModelFingerprint::of(&ck),
        &ck.tokenizer,
        &docs(12, 3),
        &cfg(None),
        &mut |_| {},
    )
    .unwrap();
    let opts = FitOptions {
        alpha: AlphaChoice::Fixed(1e-3),
        rows: FillRows {
            sink: 1,
            tail: 4,
            ..FillRows::default()
        },
        method: FillMethod::Ridge,
        adapt_weight: 0.0,
        created_by: "test".into(),
    };
    let path = dir.path().join("tiny.fill");
    fit_fill(&model, &cal.stats, &[], &opts)
        .unwrap()
        .write(&path, FillDtype::F16)
        .unwrap();
    let real = ridgefill::fetch::ensure(ridgefill::fetch::DEFAULT_MODEL).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .args([
            "generate", "--device", "cpu", "-n", "4", "-p", "hello", "--fill",
        ])
        .arg(&path)
        .arg("-m")
        .arg(&real)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("tiny.fill") && stderr.contains("weights_hash"),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing may be generated: {:?}",
        out.stdout
    );
}

fn assert_moments_close(a: &Moments, b: &Moments, what: &str) {
    assert_eq!(
        (a.features(), a.cols(), a.rows),
        (b.features(), b.cols(), b.rows),
        "{what}"
    );
    for (name, x, y) in [
        ("xtx", &a.xtx, &b.xtx),
        ("xty", &a.xty, &b.xty),
        ("y_sum", &a.y_sum, &b.y_sum),
        ("y_sq", &a.y_sq, &b.y_sq),
    ] {
        let scale = y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (p, q)) in x.iter().zip(y.iter()).enumerate() {
            assert!(
                (p - q).abs() <= 1e-9 * (1.0 + scale),
                "{what} {name}[{i}]: {p} vs {q}"
            );
        }
    }
}

#[test]
fn one_pass_over_several_splits_equals_a_pass_per_split() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, _) = deep_checkpoint(&dir);
    let model = common::load_on(&ck, &Device::flex());
    assert_eq!(model.num_layers(), DEEP_LAYERS);
    let all = docs(10, 11);
    let splits = [1, 2, 3];
    let multi = calibrate_splits_with(
        &model,
        ModelFingerprint::of(&ck),
        &ck.tokenizer,
        &all,
        &cfg(None),
        &splits,
        Control {
            progress: &mut |_| {},
            stop: &|| false,
            require_solvable: false,
            require_heldout: true,
        },
    )
    .unwrap();
    assert_eq!(multi.stats.len(), splits.len());
    assert!(!multi.heldout_windows.is_empty());
    for (&split, stats) in splits.iter().zip(&multi.stats) {
        let single = calibrate(
            &model,
            ModelFingerprint::of(&ck),
            &ck.tokenizer,
            &all,
            &CalibConfig { split, ..cfg(None) },
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(stats.meta, single.stats.meta, "split {split}");
        assert_eq!(multi.heldout_windows, single.heldout_windows);
        assert!(stats.fit.rows > 0 && stats.heldout.rows > 0);
        assert_moments_close(&stats.fit, &single.stats.fit, &format!("split {split} fit"));
        assert_moments_close(
            &stats.heldout,
            &single.stats.heldout,
            &format!("split {split} held-out"),
        );
    }
    // The window-level entry point agrees too.
    let w: Vec<u32> = ck.tokenizer.encode(&all[0].text, true).unwrap()[..32].to_vec();
    let f = model.config.hidden_size + 1;
    let kv2 = 2 * model.config.kv_dim();
    let mut ms: Vec<Moments> = [1, 3]
        .iter()
        .map(|&s| Moments::zeros(f, (DEEP_LAYERS - s) * kv2))
        .collect();
    accumulate_window_splits(&model, &w, &[1, 3], 1, &mut ms).unwrap();
    for (&s, m) in [1, 3].iter().zip(&ms) {
        let mut one = Moments::zeros(f, (DEEP_LAYERS - s) * kv2);
        accumulate_window(&model, &w, s, 1, &mut one).unwrap();
        assert_moments_close(m, &one, &format!("window, split {s}"));
    }
    // Splits out of order or out of range are refused.
    for bad in [&[2, 1][..], &[0, 2], &[1, DEEP_LAYERS]] {
        let mut ms: Vec<Moments> = bad.iter().map(|_| Moments::zeros(f, kv2)).collect();
        assert!(accumulate_window_splits(&model, &w, bad, 1, &mut ms).is_err());
    }
}

#[test]
fn default_candidates_spread_over_the_layers() {
    assert_eq!(default_split_candidates(30), vec![5, 10, 15, 20, 25]);
    assert_eq!(default_split_candidates(32), vec![6, 12, 18, 24, 30]);
    assert_eq!(default_split_candidates(16), vec![3, 6, 9, 12]);
    assert_eq!(default_split_candidates(4), vec![1, 2]);
    assert_eq!(default_split_candidates(2), vec![1]);
    for l in 2..80 {
        let c = default_split_candidates(l);
        assert!(!c.is_empty() && c.len() <= 6, "{l}: {c:?}");
        assert!(c.iter().all(|&s| 0 < s && s < l), "{l}: {c:?}");
    }
}

#[test]
fn split_search_picks_the_smallest_split_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, _) = deep_checkpoint(&dir);
    let model = common::load_on(&ck, &Device::flex());
    let splits = [1, 2, 3];
    let cal = calibrate_splits_with(
        &model,
        ModelFingerprint::of(&ck),
        &ck.tokenizer,
        &docs(30, 21),
        &cfg(None),
        &splits,
        Control {
            progress: &mut |_| {},
            stop: &|| false,
            require_solvable: true,
            require_heldout: true,
        },
    )
    .unwrap();
    let opts = FitOptions {
        alpha: AlphaChoice::Fixed(1e-3),
        rows: FillRows {
            sink: 1,
            tail: 4,
            ..FillRows::default()
        },
        method: FillMethod::Ridge,
        adapt_weight: 0.0,
        created_by: "test".into(),
    };
    let search = |budget: SplitBudget| {
        fit_fill_split_search(
            &model,
            &cal.stats,
            &cal.heldout_windows,
            &opts,
            budget,
            &|| false,
            &mut |_| {},
        )
    };
    // Everything within budget: the smallest split, with every candidate recorded.
    let loose = search(SplitBudget {
        max_kl: 1e9,
        min_top1: 0.0,
    })
    .unwrap();
    assert_eq!(loose.meta.split, 1);
    let trials = loose.meta.split_search.clone();
    assert_eq!(
        trials.iter().map(|t| t.split).collect::<Vec<_>>(),
        splits.to_vec()
    );
    for t in &trials {
        assert!(t.kl.is_finite() && t.kl > -1e-6, "{t:?}");
        assert!((0.0..=1.0).contains(&t.top1), "{t:?}");
        assert!(t.flops_ratio > 0.0 && t.flops_ratio < 1.0, "{t:?}");
    }
    // Fewer layers filled costs more FLOPs.
    assert!(
        trials
            .windows(2)
            .all(|p| p[0].flops_ratio < p[1].flops_ratio)
    );
    // The chosen candidate's file is the plain fit at that split.
    let plain = fit_fill(&model, &cal.stats[0], &cal.heldout_windows, &opts).unwrap();
    assert_eq!(loose.k, plain.k);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * (1.0 + a.abs().max(b.abs()));
    assert!(close(plain.meta.heldout_kl.unwrap(), trials[0].kl));
    assert_eq!(loose.meta.heldout_kl, Some(trials[0].kl));
    // Repeated searches measure the same (up to the last bits of the held-out passes).
    let same_trials = |got: &[SplitTrial]| {
        got.len() == trials.len()
            && got.iter().zip(&trials).all(|(a, b)| {
                a.split == b.split
                    && close(a.kl, b.kl)
                    && close(a.top1, b.top1)
                    && a.flops_ratio == b.flops_ratio
            })
    };

    // A KL budget only some candidates meet: the smallest of those.
    let max_kl = trials.iter().map(|t| t.kl).fold(f64::INFINITY, f64::min) * (1.0 + 1e-4);
    let want = trials.iter().find(|t| t.kl <= max_kl).unwrap().split;
    let tight = search(SplitBudget {
        max_kl,
        min_top1: 0.0,
    })
    .unwrap();
    assert_eq!(tight.meta.split, want);
    assert!(same_trials(&tight.meta.split_search));
    assert_eq!(tight.k.len(), DEEP_LAYERS - want);

    // A top-1 floor alone.
    let min_top1 = trials.iter().map(|t| t.top1).fold(0.0, f64::max);
    let want = trials.iter().find(|t| t.top1 >= min_top1).unwrap().split;
    let floor = search(SplitBudget {
        max_kl: 1e9,
        min_top1,
    })
    .unwrap();
    assert_eq!(floor.meta.split, want);

    // An impossible budget: a typed error carrying every trial, naming the best candidate.
    let budget = SplitBudget {
        max_kl: 0.0,
        min_top1: 0.0,
    };
    match search(budget) {
        Err(e @ FitError::NoSplitWithinBudget { .. }) => {
            let msg = e.to_string();
            let FitError::NoSplitWithinBudget { trials: got, .. } = e else {
                unreachable!()
            };
            assert!(same_trials(&got));
            let best = trials.iter().min_by(|a, b| a.kl.total_cmp(&b.kl)).unwrap();
            assert!(
                msg.contains("no candidate split is within the budget")
                    && msg.contains(&format!("split {}", best.split))
                    && msg.contains("--max-kl"),
                "{msg}"
            );
        }
        other => panic!(
            "expected NoSplitWithinBudget, got {:?}",
            other.map(|f| f.meta)
        ),
    }

    // Ctrl-C: the search stops.
    let err = fit_fill_split_search(
        &model,
        &cal.stats,
        &cal.heldout_windows,
        &opts,
        SplitBudget {
            max_kl: 1e9,
            min_top1: 0.0,
        },
        &|| true,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(err, FitError::Stopped), "{err:?}");
}

#[test]
fn fit_split_auto_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let (_, model) = deep_checkpoint(&dir);
    let calib = dir.path().join("calib");
    std::fs::create_dir(&calib).unwrap();
    for i in 0..16 {
        std::fs::write(
            calib.join(format!("doc{i:02}.txt")),
            tiny::words(150, i + 1),
        )
        .unwrap();
    }
    let out = dir.path().join("auto.fill");
    let fit = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ridgefill"));
        cmd.arg("fit")
            .arg("-m")
            .arg(&model)
            .args([
                "--device", "cpu", "--ctx", "32", "--alpha", "1e-3", "--tail", "4",
            ])
            .arg("--calib")
            .arg(&calib)
            .args(extra)
            .arg("-o")
            .arg(&out)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let ok = fit(&["--split", "auto", "--max-kl", "1000", "--candidates", "2,1"]);
    let stderr = String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "{stderr}");
    assert!(
        stderr.contains("split search") && stderr.contains("<- chosen"),
        "{stderr}"
    );
    let file = ridgefill::io::fill::FillFile::read(&out).unwrap();
    assert_eq!(file.meta.split, 1);
    assert_eq!(
        file.meta
            .split_search
            .iter()
            .map(|t| t.split)
            .collect::<Vec<_>>(),
        vec![1, 2]
    );
    std::fs::remove_file(&out).unwrap();

    // No candidate within budget: the table, a clear error, and no file. Plain ridge: on windows
    // this short the shipped method's minimum spans cover every bulk row (KL 0).
    let none = fit(&[
        "--split",
        "auto",
        "--max-kl",
        "0",
        "--candidates",
        "1,2",
        "--method",
        "ridge",
    ]);
    let stderr = String::from_utf8_lossy(&none.stderr);
    assert_eq!(none.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("split search")
            && stderr.contains("no candidate split is within the budget")
            && stderr.contains("give a larger --max-kl (--max-kl "),
        "{stderr}"
    );
    assert!(!out.exists());

    // Flags that do not go together, refused before any work.
    for (extra, needle) in [
        (&["--split", "auto"][..], "--split auto needs --max-kl"),
        (
            &["--split", "1", "--max-kl", "1"],
            "only apply to --split auto",
        ),
        (
            &["--candidates", "1", "--split", "1"],
            "only apply to --split auto",
        ),
        (
            &["--split", "auto", "--max-kl", "1", "--stats-out", "x.stats"],
            "does not support --stats-out",
        ),
        (
            &["--split", "auto", "--max-kl", "1", "--candidates", "1,4"],
            "--candidates: split 4 is out of range for a 4-layer model",
        ),
    ] {
        let o = fit(extra);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {stderr}");
        assert!(stderr.contains(needle), "{extra:?}: {stderr}");
        assert!(!out.exists());
    }
    let o = fit(&["--split", "deep", "--max-kl", "1"]);
    assert_eq!(o.status.code(), Some(2));
}
