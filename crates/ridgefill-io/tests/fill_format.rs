//! Fill and statistics files: round trips, atomic writes, and one typed error per bad input,
//! each naming the file and the field or tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ridgefill_io::IoError;
use ridgefill_io::fill::{
    AlphaTrial, FEATURE_KIND, FILL_FORMAT_VERSION, FillDtype, FillFile, FillMeta, LayerQuality,
    METADATA_KEY, ModelFingerprint,
};
use ridgefill_io::stats::{Moments, STATS_FORMAT_VERSION, StatsFile, StatsMeta};
use ridgefill_testkit::{self as testkit, tiny};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};

const HIDDEN: usize = 4;
const LAYERS: usize = 3;
const SPLIT: usize = 1;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 2;
const KV_DIM: usize = KV_HEADS * HEAD_DIM;
const FEATURES: usize = HIDDEN + 1;
const COLS: usize = (LAYERS - SPLIT) * 2 * KV_DIM;
/// Relative spacing of f16 values (10 stored mantissa bits), halved for round-to-nearest.
const F16_REL_ERR: f32 = 1.0 / 2048.0;

fn fingerprint() -> ModelFingerprint {
    ModelFingerprint {
        architecture: "llama".into(),
        hidden_size: HIDDEN,
        num_hidden_layers: LAYERS,
        num_key_value_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        vocab_size: 32,
        weights_hash: "0123456789abcdef".into(),
    }
}

fn meta() -> FillMeta {
    FillMeta {
        format_version: FILL_FORMAT_VERSION,
        model: fingerprint(),
        split: SPLIT,
        sink: 1,
        feature: FEATURE_KIND.into(),
        alpha: 1e-3,
        lambda: 0.25,
        calib_tokens: 1000,
        calib_sources: vec!["a.txt".into(), "b.txt".into()],
        heldout_tokens: 100,
        quality: (SPLIT..LAYERS)
            .map(|layer| LayerQuality {
                layer,
                r2_k: 0.9,
                r2_v: 0.8,
            })
            .collect(),
        heldout_kl: Some(0.01),
        alpha_grid: vec![AlphaTrial {
            alpha: 1e-3,
            lambda: 0.25,
            kl: 0.01,
        }],
        created_by: "fill_format test".into(),
        method: Default::default(),
        split_search: Vec::new(),
    }
}

/// Distinct, non-trivial values in a range f16 represents as normal numbers.
fn map_values(seed: usize) -> Vec<f32> {
    (0..FEATURES * KV_DIM)
        .map(|i| ((seed * 31 + i * 7) % 23) as f32 * 0.37 - 4.1)
        .collect()
}

fn fill() -> FillFile {
    let upper = LAYERS - SPLIT;
    FillFile {
        meta: meta(),
        k: (0..upper).map(|i| map_values(2 * i)).collect(),
        v: (0..upper).map(|i| map_values(2 * i + 1)).collect(),
        precision: None,
    }
}

/// [`testkit::assert_names`], and the error's own path is that file.
fn assert_names(err: &IoError, path: &Path, needles: &[&str]) {
    assert_eq!(err.path(), path, "{err}");
    testkit::assert_names(err, path, needles);
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// One tensor of a hand-built file.
struct Raw {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn raw_f32(name: &str, shape: &[usize], values: &[f32]) -> Raw {
    Raw {
        name: name.into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The tensors of a valid fill file, as F32.
fn good_tensors() -> Vec<Raw> {
    let f = fill();
    let mut out = Vec::new();
    for (i, (k, v)) in f.k.iter().zip(&f.v).enumerate() {
        let l = SPLIT + i;
        out.push(raw_f32(&format!("fill.{l}.k"), &[FEATURES, KV_DIM], k));
        out.push(raw_f32(&format!("fill.{l}.v"), &[FEATURES, KV_DIM], v));
    }
    out
}

/// Writes a safetensors file by hand; `meta` goes under the `ridgefill` key when given.
fn write_raw(path: &Path, meta: Option<String>, tensors: &[Raw]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            let view = TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap();
            (t.name.clone(), view)
        })
        .collect();
    let info = meta.map(|m| HashMap::from([(METADATA_KEY.to_string(), m)]));
    std::fs::write(path, safetensors::serialize(views, info).unwrap()).unwrap();
}

fn meta_json() -> Value {
    serde_json::to_value(meta()).unwrap()
}

/// A fill file with edited metadata and tensors; returns the read error.
fn read_err(dir: &Path, meta: Option<Value>, tensors: &[Raw]) -> (PathBuf, IoError) {
    let path = dir.join("bad.fill.safetensors");
    write_raw(&path, meta.map(|m| m.to_string()), tensors);
    let err = FillFile::read(&path).expect_err("reading must fail");
    (path, err)
}

#[test]
fn fill_round_trip_f32_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.fill.safetensors");
    let f = fill();
    f.write(&path, FillDtype::F32).unwrap();
    assert_eq!(FillFile::read(&path).unwrap(), f);
}

#[test]
fn fill_round_trip_f16_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.fill.safetensors");
    let f = fill();
    f.write(&path, FillDtype::F16).unwrap();
    let back = FillFile::read(&path).unwrap();
    assert_eq!(back.meta, f.meta);
    for (a, b) in f.k.iter().chain(&f.v).zip(back.k.iter().chain(&back.v)) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= x.abs() * F16_REL_ERR, "{x} vs {y}");
        }
    }
    // Half the bytes of F32, plus the same header.
    let f32_path = dir.path().join("m32.fill.safetensors");
    f.write(&f32_path, FillDtype::F32).unwrap();
    let (s16, s32) = (
        std::fs::metadata(&path).unwrap().len(),
        std::fs::metadata(&f32_path).unwrap().len(),
    );
    assert!(s16 < s32, "f16 {s16} bytes, f32 {s32} bytes");
}

#[test]
fn atomic_write_leaves_only_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.fill.safetensors");
    fill().write(&path, FillDtype::F32).unwrap();
    // Overwriting an existing file replaces it in place.
    let mut g = fill();
    g.k[0][0] = 42.0;
    g.write(&path, FillDtype::F32).unwrap();
    assert_eq!(dir_entries(dir.path()), vec!["m.fill.safetensors"]);
    assert_eq!(FillFile::read(&path).unwrap().k[0][0], 42.0);
}

#[test]
fn failed_write_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").join("m.fill.safetensors");
    let err = fill().write(&missing, FillDtype::F32).unwrap_err();
    assert!(matches!(err, IoError::Os { .. }), "{err:?}");
    assert_names(&err, &missing, &["temporary file"]);
    assert!(!missing.exists());

    // A value read would reject is refused before anything is written.
    let path = dir.path().join("m.fill.safetensors");
    let mut f = fill();
    f.v[1][3] = f32::NAN;
    let err = f.write(&path, FillDtype::F32).unwrap_err();
    assert!(matches!(err, IoError::NonFinite { .. }), "{err:?}");
    assert_names(&err, &path, &["fill.2.v", "element 3", "NaN"]);
    // A finite f32 beyond f16's range would be stored as infinity.
    let mut f = fill();
    f.k[0][1] = 1e6;
    let err = f.write(&path, FillDtype::F16).unwrap_err();
    assert_names(
        &err,
        &path,
        &["fill.1.k", "element 1", "F16 range", "1000000"],
    );
    // JSON cannot hold NaN.
    let mut f = fill();
    f.meta.quality[1].r2_v = f64::NAN;
    let err = f.write(&path, FillDtype::F32).unwrap_err();
    assert_names(&err, &path, &["quality[1].r2_v"]);
    // The wrong number of maps for the split.
    let mut f = fill();
    f.k.pop();
    let err = f.write(&path, FillDtype::F32).unwrap_err();
    assert_names(&err, &path, &["number of K maps", "expected 2", "found 1"]);
    assert!(
        dir_entries(dir.path()).is_empty(),
        "{:?}",
        dir_entries(dir.path())
    );
}

#[test]
fn garbage_bytes_are_not_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.safetensors");
    std::fs::write(&path, b"this is certainly not a safetensors file at all").unwrap();
    let err = FillFile::read(&path).unwrap_err();
    assert!(matches!(err, IoError::Safetensors { .. }), "{err:?}");
    assert_names(&err, &path, &["invalid safetensors"]);

    std::fs::write(&path, b"").unwrap();
    let err = FillFile::read(&path).unwrap_err();
    assert_names(&err, &path, &["invalid safetensors", "0 bytes"]);
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.fill.safetensors");
    fill().write(&path, FillDtype::F32).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let err = FillFile::read(&path).unwrap_err();
    assert!(matches!(err, IoError::Safetensors { .. }), "{err:?}");
    assert_names(&err, &path, &["invalid safetensors"]);
    // Cut inside the header.
    std::fs::write(&path, &bytes[..bytes.len() / 4]).unwrap();
    let err = FillFile::read(&path).unwrap_err();
    assert_names(&err, &path, &["invalid safetensors"]);
}

#[test]
fn missing_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let (path, err) = read_err(dir.path(), None, &good_tensors());
    assert!(matches!(err, IoError::MissingMetadata { .. }), "{err:?}");
    assert_names(&err, &path, &["__metadata__.ridgefill", "missing"]);

    // Present but not JSON.
    let path = dir.path().join("notjson.safetensors");
    write_raw(&path, Some("{not json".into()), &good_tensors());
    let err = FillFile::read(&path).unwrap_err();
    assert_names(&err, &path, &["__metadata__.ridgefill", "invalid JSON"]);

    // JSON without a required field.
    let mut m = meta_json();
    m.as_object_mut().unwrap().remove("split");
    let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
    assert_names(&err, &path, &["ridgefill", "split"]);
}

#[test]
fn wrong_format_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta_json();
    m["format_version"] = json!(3);
    // A newer version may change the schema: the version is reported, not a schema error.
    m.as_object_mut().unwrap().remove("quality");
    let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
    assert!(matches!(err, IoError::BadMetadata { .. }), "{err:?}");
    assert_names(
        &err,
        &path,
        &["ridgefill.format_version", "expected 1 or 2", "found 3"],
    );
}

#[test]
fn bad_method_fields_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            json!({"name": "lasso", "exact": 0.05, "span_radius": 8, "adapt_weight": 0.0}),
            "ridgefill.method.name",
        ),
        (
            json!({"name": "spans", "exact": 1.5, "span_radius": 8, "adapt_weight": 0.0}),
            "ridgefill.method.exact",
        ),
        (
            json!({"name": "spans", "exact": 0.05, "span_radius": 8, "adapt_weight": -1.0}),
            "ridgefill.method.adapt_weight",
        ),
        // spans-adapt needs the precision matrix, which these tensors lack.
        (
            json!({"name": "spans-adapt", "exact": 0.05, "span_radius": 8, "adapt_weight": 100.0}),
            "fill.precision",
        ),
    ];
    for (method, needle) in cases {
        let mut m = meta_json();
        m["format_version"] = json!(2);
        m["method"] = method;
        let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
        assert_names(&err, &path, &[needle]);
    }
}

#[test]
fn wrong_feature_kind() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta_json();
    m["feature"] = json!("layernorm");
    let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
    assert_names(
        &err,
        &path,
        &["ridgefill.feature", "layernorm", FEATURE_KIND],
    );
}

#[test]
fn split_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    for split in [0, LAYERS, LAYERS + 5] {
        let mut m = meta_json();
        m["split"] = json!(split);
        let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
        assert!(matches!(err, IoError::BadMetadata { .. }), "{err:?}");
        assert_names(
            &err,
            &path,
            &[
                "ridgefill.split",
                &format!("found {split}"),
                "num_hidden_layers 3",
            ],
        );
    }
}

#[test]
fn absurd_layer_count_does_not_hang_or_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta_json();
    m["model"]["num_hidden_layers"] = json!(1u64 << 40);
    let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
    assert!(matches!(err, IoError::MissingTensor { .. }), "{err:?}");
    assert_names(&err, &path, &["fill.3.k"]);

    let mut m = meta_json();
    m["model"]["hidden_size"] = json!(usize::MAX);
    let (path, err) = read_err(dir.path(), Some(m), &good_tensors());
    assert_names(
        &err,
        &path,
        &["ridgefill.model", "hidden_size 18446744073709551615"],
    );
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = good_tensors();
    t.retain(|t| t.name != "fill.2.v");
    let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
    assert!(matches!(err, IoError::MissingTensor { .. }), "{err:?}");
    assert_names(&err, &path, &["\"fill.2.v\"", "not found"]);
}

#[test]
fn unexpected_tensor() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["fill.0.k", "fill.3.v", "fill.01.k", "fill.1.q", "extra"] {
        let mut t = good_tensors();
        t.push(raw_f32(name, &[FEATURES, KV_DIM], &map_values(0)));
        let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
        assert!(matches!(err, IoError::UnexpectedTensor { .. }), "{err:?}");
        assert_names(
            &err,
            &path,
            &[
                &format!("{name:?}"),
                "fill.{l}.k and fill.{l}.v for l in 1..3",
            ],
        );
    }
}

#[test]
fn wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = good_tensors();
    t[1] = raw_f32("fill.1.v", &[KV_DIM, FEATURES], &map_values(1));
    let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
    assert!(matches!(err, IoError::BadTensor { .. }), "{err:?}");
    assert_names(&err, &path, &["fill.1.v", "shape", "[5, 2]", "[2, 5]"]);
}

#[test]
fn nan_value() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = good_tensors();
    let mut values = map_values(3);
    values[7] = f32::INFINITY;
    t[3] = raw_f32("fill.2.v", &[FEATURES, KV_DIM], &values);
    let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
    assert!(matches!(err, IoError::NonFinite { .. }), "{err:?}");
    assert_names(&err, &path, &["fill.2.v", "element 7", "inf"]);

    // NaN stored as F16.
    let mut t = good_tensors();
    let mut bytes: Vec<u8> = map_values(0)
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    bytes[..2].copy_from_slice(&half::f16::NAN.to_le_bytes());
    t[0] = Raw {
        name: "fill.1.k".into(),
        dtype: Dtype::F16,
        shape: vec![FEATURES, KV_DIM],
        bytes,
    };
    let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
    assert_names(&err, &path, &["fill.1.k", "element 0", "NaN"]);
}

#[test]
fn wrong_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = good_tensors();
    t[2] = Raw {
        name: "fill.2.k".into(),
        dtype: Dtype::I32,
        shape: vec![FEATURES, KV_DIM],
        bytes: vec![0; FEATURES * KV_DIM * 4],
    };
    let (path, err) = read_err(dir.path(), Some(meta_json()), &t);
    assert!(matches!(err, IoError::BadTensor { .. }), "{err:?}");
    assert_names(&err, &path, &["fill.2.k", "dtype", "F32 or F16", "I32"]);
}

#[test]
fn fingerprint_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.fill.safetensors");
    let f = fill();
    f.check_model(&path, &fingerprint()).unwrap();
    let mut other = fingerprint();
    other.weights_hash = "fedcba9876543210".into();
    other.vocab_size = 64;
    let err = f.check_model(&path, &other).unwrap_err();
    let IoError::ModelMismatch { fields, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(fields.len(), 2);
    assert_names(
        &err,
        &path,
        &[
            "fill file was made for a model with",
            "weights_hash 0123456789abcdef, this model has fedcba9876543210",
            "vocab_size 32, this model has 64",
        ],
    );
}

#[test]
fn fingerprint_of_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    tiny::write_gguf(&tiny::tiny(), &path, &tiny::Faults::default());
    let ckpt = ridgefill_io::Checkpoint::open(&path).unwrap();
    let fp = ModelFingerprint::of(&ckpt);
    let c = &ckpt.config;
    assert_eq!(fp.architecture, c.model_type);
    assert_eq!(
        (fp.hidden_size, fp.num_hidden_layers, fp.vocab_size),
        (c.hidden_size, c.num_hidden_layers, c.vocab_size)
    );
    assert_eq!(fp.kv_dim(), c.kv_dim());
    assert_eq!(fp.weights_hash, ckpt.weights_fingerprint());
    let mut f = fill();
    f.meta.model = fp.clone();
    f.check_model(&path, &fp).unwrap();
}

// ---- statistics ----

fn stats_meta(sources: &[&str]) -> StatsMeta {
    StatsMeta {
        format_version: STATS_FORMAT_VERSION,
        model: fingerprint(),
        split: SPLIT,
        sink: 1,
        feature: FEATURE_KIND.into(),
        ctx: 64,
        sources: sources.iter().map(|s| s.to_string()).collect(),
    }
}

fn moments(seed: u64, rows: u64) -> Moments {
    let mut m = Moments::zeros(FEATURES, COLS);
    m.rows = rows;
    let val = |i: usize| ((seed as usize * 13 + i * 5) % 17) as f64 * 0.125 - 1.0;
    for (off, v) in [&mut m.xtx, &mut m.xty, &mut m.y_sum, &mut m.y_sq]
        .into_iter()
        .enumerate()
    {
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = val(i + off * 100));
    }
    m
}

fn stats(seed: u64, sources: &[&str]) -> StatsFile {
    StatsFile {
        meta: stats_meta(sources),
        fit: moments(seed, 1000 + seed),
        heldout: moments(seed + 7, 100 + seed),
    }
}

#[test]
fn moments_shape_and_add() {
    let mut a = moments(1, 10);
    assert_eq!((a.features(), a.cols()), (FEATURES, COLS));
    let b = moments(2, 5);
    a.add(&b).unwrap();
    assert_eq!(a.rows, 15);
    assert_eq!(a.xty[3], moments(1, 0).xty[3] + b.xty[3]);
    let before = a.clone();
    let err = a.add(&Moments::zeros(FEATURES, COLS + 1)).unwrap_err();
    assert!(err.contains("xty"), "{err}");
    assert_eq!(a, before, "a failed add changes nothing");
}

#[test]
fn stats_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.stats.safetensors");
    let s = stats(1, &["a.txt"]);
    s.write(&path).unwrap();
    assert_eq!(dir_entries(dir.path()), vec!["s.stats.safetensors"]);
    assert_eq!(StatsFile::read(&path).unwrap(), s);
}

#[test]
fn stats_merge_sums_every_moment() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (stats(1, &["a.txt"]), stats(2, &["b.txt", "c.txt"]));
    let (pa, pb) = (dir.path().join("a.st"), dir.path().join("b.st"));
    a.write(&pa).unwrap();
    b.write(&pb).unwrap();
    let merged = StatsFile::merge(&[pa.clone(), pb]).unwrap();
    let (mut fit, mut heldout) = (a.fit.clone(), a.heldout.clone());
    fit.add(&b.fit).unwrap();
    heldout.add(&b.heldout).unwrap();
    assert_eq!(merged.fit, fit);
    assert_eq!(merged.heldout, heldout);
    assert_eq!(merged.meta.sources, vec!["a.txt", "b.txt", "c.txt"]);
    assert_eq!(merged.meta.split, SPLIT);
    // One shard merges to itself.
    assert_eq!(StatsFile::merge(&[pa]).unwrap(), a);
}

#[test]
fn stats_merge_refuses_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let pa = dir.path().join("a.st");
    stats(1, &["a.txt"]).write(&pa).unwrap();

    let pb = dir.path().join("split2.st");
    let mut b = stats(2, &["b.txt"]);
    b.meta.split = 2;
    b.fit = Moments::zeros(FEATURES, (LAYERS - 2) * 2 * KV_DIM);
    b.heldout = b.fit.clone();
    b.write(&pb).unwrap();
    let err = StatsFile::merge(&[pa.clone(), pb.clone()]).unwrap_err();
    assert!(matches!(err, IoError::ShardMismatch { .. }), "{err:?}");
    assert_names(&err, &pb, &["split", &pa.display().to_string()]);

    let pc = dir.path().join("model.st");
    let mut c = stats(3, &["c.txt"]);
    c.meta.model.weights_hash = "ffff".into();
    c.write(&pc).unwrap();
    let err = StatsFile::merge(&[pa.clone(), pc.clone()]).unwrap_err();
    assert_names(
        &err,
        &pc,
        &[
            "model.weights_hash",
            "ffff",
            "0123456789abcdef",
            &pa.display().to_string(),
        ],
    );

    let pd = dir.path().join("ctx.st");
    let mut d = stats(4, &["d.txt"]);
    d.meta.ctx = 128;
    d.write(&pd).unwrap();
    let err = StatsFile::merge(&[pa.clone(), pd.clone()]).unwrap_err();
    assert_names(&err, &pd, &["ctx", "128", "64"]);

    let err = StatsFile::merge(&[]).unwrap_err();
    assert!(err.to_string().contains("none given"), "{err}");
}

/// The tensors of a valid statistics file, built by hand.
fn stats_raw(s: &StatsFile, rows_dtype: Dtype) -> Vec<Raw> {
    let f64s = |name: String, shape: Vec<usize>, v: &[f64]| Raw {
        name,
        dtype: Dtype::F64,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let mut out = Vec::new();
    for (p, m) in [("fit", &s.fit), ("heldout", &s.heldout)] {
        out.push(f64s(format!("{p}.xtx"), vec![FEATURES, FEATURES], &m.xtx));
        out.push(f64s(format!("{p}.xty"), vec![FEATURES, COLS], &m.xty));
        out.push(f64s(format!("{p}.y_sum"), vec![COLS], &m.y_sum));
        out.push(f64s(format!("{p}.y_sq"), vec![COLS], &m.y_sq));
        out.push(Raw {
            name: format!("{p}.rows"),
            dtype: rows_dtype,
            shape: vec![1],
            bytes: match rows_dtype {
                Dtype::F64 => (m.rows as f64).to_le_bytes().to_vec(),
                _ => (m.rows as i64).to_le_bytes().to_vec(),
            },
        });
    }
    out
}

#[test]
fn stats_rows_may_be_f64() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.st");
    let s = stats(5, &["x"]);
    let json = serde_json::to_string(&s.meta).unwrap();
    write_raw(&path, Some(json), &stats_raw(&s, Dtype::F64));
    assert_eq!(StatsFile::read(&path).unwrap(), s);
}

#[test]
fn stats_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.st");
    let s = stats(6, &["x"]);
    let json = serde_json::to_string(&s.meta).unwrap();
    let read = |meta: &str, t: &[Raw]| {
        write_raw(&path, Some(meta.to_string()), t);
        StatsFile::read(&path).unwrap_err()
    };

    // F32 moments lose the precision the solve needs.
    let mut t = stats_raw(&s, Dtype::I64);
    t[1] = raw_f32("fit.xty", &[FEATURES, COLS], &[0.0; FEATURES * COLS]);
    assert_names(&read(&json, &t), &path, &["fit.xty", "dtype", "F64", "F32"]);

    let mut t = stats_raw(&s, Dtype::I64);
    t[7].shape = vec![COLS / 2, 2];
    assert_names(&read(&json, &t), &path, &["heldout.y_sum", "shape"]);

    let mut t = stats_raw(&s, Dtype::I64);
    t[8].bytes[8..16].copy_from_slice(&f64::NAN.to_le_bytes());
    assert_names(&read(&json, &t), &path, &["heldout.y_sq", "element 1"]);

    let mut t = stats_raw(&s, Dtype::I64);
    t[4].bytes = (-3i64).to_le_bytes().to_vec();
    assert_names(&read(&json, &t), &path, &["fit.rows", "-3"]);

    let mut t = stats_raw(&s, Dtype::I64);
    t.remove(3);
    assert_names(&read(&json, &t), &path, &["fit.y_sq", "not found"]);

    let mut t = stats_raw(&s, Dtype::I64);
    t.push(raw_f32("fit.extra", &[1], &[0.0]));
    assert_names(&read(&json, &t), &path, &["fit.extra", "unexpected"]);

    let mut m: Value = serde_json::from_str(&json).unwrap();
    m["format_version"] = json!(7);
    let err = read(&m.to_string(), &stats_raw(&s, Dtype::I64));
    assert_names(&err, &path, &["ridgefill.format_version", "found 7"]);

    let mut m: Value = serde_json::from_str(&json).unwrap();
    m["split"] = json!(0);
    let err = read(&m.to_string(), &stats_raw(&s, Dtype::I64));
    assert_names(&err, &path, &["ridgefill.split", "found 0"]);

    // Moments that disagree with the metadata are refused on write, naming the tensor.
    let out = dir.path().join("out.st");
    let mut bad = s.clone();
    bad.fit.y_sum.pop();
    let err = bad.write(&out).unwrap_err();
    assert_names(&err, &out, &["fit.y_sum", "number of values"]);
    assert!(!out.exists());
}

/// The held-out error the default self-check threshold scales: `1 − R²` of K and V averaged
/// over the layers; none for a file that measured nothing.
#[test]
fn heldout_error_averages_one_minus_r2_over_k_v_and_layers() {
    let mut m = meta();
    let e = m.heldout_error().unwrap();
    assert!((e - 0.15).abs() < 1e-12, "{e}");
    m.quality[0].r2_v = 0.6;
    let want = 0.15 + 0.1 / (LAYERS - SPLIT) as f64;
    assert!((m.heldout_error().unwrap() - want).abs() < 1e-12);
    m.quality.clear();
    assert_eq!(m.heldout_error(), None);
}
