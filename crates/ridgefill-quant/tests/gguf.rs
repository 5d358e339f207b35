//! Kernels on real GGUF tensors (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M), pointing into the
//! mapped file. Skipped with a message when the model files are not present.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use ridgefill_io::GgufFile;
use ridgefill_quant::{
    GgmlType, MatmulConfig, MatmulPath, QMatrix, QWeight, SimdLevel, WeightBytes,
};

/// A fetched model; a missing one fails the test, saying how to fetch it.
fn open(rel: &str) -> Arc<GgufFile> {
    let path = ridgefill_testkit::fetched_model(rel, None);
    Arc::new(GgufFile::open(&path).expect("readable GGUF"))
}

const SMOLLM: &str = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA: &str = "gemma3-270m/gemma-3-270m-q4_k_m.gguf";

/// The first `rows` rows of a tensor, still pointing into the file.
fn first_rows(file: &Arc<GgufFile>, name: &str, rows: usize) -> QMatrix {
    let full = QMatrix::from_gguf(file, name).expect("2-D tensor");
    let rows = rows.min(full.rows());
    let len = rows * full.row_bytes();
    let info = file.tensor_info(name).unwrap().clone();
    let bytes = WeightBytes::from_owner(file.clone(), move |f| &f.bytes_of(&info)[..len]);
    QMatrix::new(full.ty(), rows, full.cols(), bytes).unwrap()
}

/// For each type in the file, up to two 2-D tensors of it, checked at every level on m = 1, 3.
fn check_file(file: &Arc<GgufFile>) {
    let mut by_type: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for t in file.tensors() {
        if t.ne.len() == 2 {
            by_type
                .entry(t.ggml_type.name())
                .or_default()
                .push(t.name.clone());
        }
    }
    eprintln!(
        "{}: {:?}",
        file.path().display(),
        by_type
            .iter()
            .map(|(k, v)| (k, v.len()))
            .collect::<Vec<_>>()
    );
    let mut rng = Rng::new(0x6617);
    for names in by_type.values() {
        for name in names.iter().take(2) {
            let rows = QWeight::from(first_rows(file, name, 96));
            // The row-lane layout (a no-op where it does not apply) on the same tensors.
            let lanes = rows.clone().prepared_for(SimdLevel::Avx512Vnni);
            for (w, m) in [&rows, &lanes].into_iter().flat_map(|w| [(w, 1), (w, 3)]) {
                // Activations like a normed hidden state: unit scale with a few outliers.
                let mut x: Vec<f32> = (0..m * w.cols()).map(|_| rng.sym()).collect();
                for _ in 0..m {
                    let i = rng.below(x.len());
                    x[i] *= 30.0;
                }
                let r = reference_stacked(w, &x, m);
                for level in SimdLevel::available() {
                    for path in [MatmulPath::Integer, MatmulPath::DequantGemm] {
                        let cfg = MatmulConfig {
                            level,
                            path,
                            parallel: true,
                        };
                        let mut y = vec![f32::NAN; m * w.rows()];
                        w.matmul_with(&cfg, &x, m, &mut y).unwrap();
                        let lanes = w.parts()[0].is_row_lanes();
                        let what = format!("{name} m={m} {cfg:?} row lanes {lanes}");
                        assert_close(&what, &y, &r.y, &r.tol());
                    }
                }
            }
        }
    }
}

#[test]
fn smollm2_tensors() {
    let file = open(SMOLLM);
    check_file(&file);
}

#[test]
fn gemma3_tensors() {
    let file = open(GEMMA);
    check_file(&file);
}

#[test]
fn gemma3_fused_qkv_of_mixed_types() {
    let file = open(GEMMA);
    // Q4_K_M keeps some attn_v in Q6_K: find a layer whose q/k/v types differ if there is one.
    let ty = |n: &str| file.tensor_info(n).map(|t| t.ggml_type);
    let layer = (0..64)
        .find(|l| {
            let t = |s: &str| ty(&format!("blk.{l}.attn_{s}.weight"));
            t("q").is_some() && (t("q") != t("v") || t("k") != t("v"))
        })
        .unwrap_or(0);
    let parts: Vec<QMatrix> = ["q", "k", "v"]
        .iter()
        .map(|s| QMatrix::from_gguf(&file, &format!("blk.{layer}.attn_{s}.weight")).unwrap())
        .collect();
    eprintln!(
        "layer {layer} qkv types: {:?}",
        parts.iter().map(|p| p.ty()).collect::<Vec<GgmlType>>()
    );
    let w = QWeight::new(parts).unwrap();
    let mut rng = Rng::new(7);
    for m in [1, 17] {
        let x: Vec<f32> = (0..m * w.cols()).map(|_| rng.sym()).collect();
        let r = reference_stacked(&w, &x, m);
        let mut y = vec![0f32; m * w.rows()];
        w.matmul(&x, m, &mut y).unwrap();
        assert_close(&format!("fused qkv m={m}"), &y, &r.y, &r.tol());
    }
}
