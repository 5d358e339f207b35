//! Dequantisation goldens produced by python gguf (`scripts/dequant_golden.py`).
//!
//! Values are compared bit for bit: both sides do the same f32 operations in the same order
//! (scale products first, then multiply/add with no fused multiply-add), so exact equality holds.

use std::collections::BTreeSet;
use std::path::PathBuf;

use ridgefill_io::quant::{GgmlType, dequantize};
use serde::Deserialize;

/// Types the crate promises to dequantise; each must have a golden case.
const REQUIRED_TYPES: &[&str] = &[
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
];

#[derive(Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    #[serde(rename = "type")]
    type_name: String,
    ggml_type: u32,
    n_elements: usize,
    raw_hex: String,
    values: Vec<f64>,
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dequant.json")
}

fn from_hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn load() -> Golden {
    let path = golden_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (generate it with scripts/dequant_golden.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_case_is_bit_exact() {
    let golden = load();
    assert!(
        !golden.cases.is_empty(),
        "no cases in {}",
        golden_path().display()
    );
    for case in &golden.cases {
        let ty = GgmlType::from_id(case.ggml_type).unwrap_or_else(|| {
            panic!(
                "{}: unknown ggml type id {}",
                case.type_name, case.ggml_type
            )
        });
        assert_eq!(ty.name(), case.type_name, "type id {} name", case.ggml_type);
        let raw = from_hex(&case.raw_hex);
        let got = dequantize(ty, &raw, case.n_elements)
            .unwrap_or_else(|e| panic!("{}: {e}", case.type_name));
        assert_eq!(
            got.len(),
            case.values.len(),
            "{}: element count",
            case.type_name
        );
        for (i, (&g, &want)) in got.iter().zip(&case.values).enumerate() {
            let want = want as f32;
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "{} element {i}: got {g:e}, want {want:e}",
                case.type_name
            );
        }
    }
}

#[test]
fn every_supported_type_has_a_case() {
    let golden = load();
    let have: BTreeSet<&str> = golden.cases.iter().map(|c| c.type_name.as_str()).collect();
    for t in REQUIRED_TYPES {
        assert!(have.contains(t), "no golden case for {t}");
    }
    for t in GgmlType::ALL.iter().filter(|t| t.can_dequantize()) {
        assert!(
            have.contains(t.name()),
            "dequantisable type {t} has no golden case"
        );
    }
}
