//! Calibration and ridge fit on the tiny random Llama (no network): the fit recovers what is
//! exactly linear, shards merge to one pass, and fill files round-trip into the engine.

mod common;
#[path = "../crates/ridgefill-io/tests/common/mod.rs"]
mod tiny;

use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::io::fill::{FillDtype, ModelFingerprint};
use ridgefill::io::stats::{Moments, StatsFile};
use ridgefill::io::text::Document;
use ridgefill::model::fill::FillRows;
use ridgefill::model::{Device, to_host_f32};
use ridgefill_fit::calibrate::{CalibConfig, accumulate_window, calibrate};
use ridgefill_fit::solve::{AlphaChoice, FitOptions, fit_fill, ridge_solve};

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
        rows: FillRows { sink: 1, tail: 4 },
        created_by: "test".into(),
    };
    let file = fit_fill(&model, &cal.stats, &cal.heldout_windows, &opts).unwrap();
    // Layer `split` reads h_split through its own norm: its K/V are exactly linear in the features.
    let q = &file.meta.quality[0];
    assert_eq!(q.layer, SPLIT);
    assert!(q.r2_k > 0.9999 && q.r2_v > 0.9999, "{q:?}");
    let own = to_host_f32(model.own_proj_maps(SPLIT).unwrap().w);
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
    let logits = model
        .prefill_fill(
            &ids,
            &mut model.new_cache(20),
            &maps,
            FillRows { sink: 1, tail: 4 },
        )
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
        rows: FillRows { sink: 1, tail: 4 },
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
