//! Inconsistent sizes are errors, never panics or out-of-bounds reads.

use std::path::Path;
use std::sync::Arc;

use ridgefill_io::GgufFile;
use ridgefill_io::gguf::writer::GgufWriter;
use ridgefill_quant::{GgmlType, QError, QMatrix, QWeight, WeightBytes};

fn bytes(n: usize) -> WeightBytes {
    WeightBytes::from_vec(vec![0u8; n])
}

#[test]
fn constructor_rejects_bad_shapes() {
    // Q4_0: 18 bytes per 32 values.
    assert!(QMatrix::new(GgmlType::Q4_0, 2, 64, bytes(72)).is_ok());
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_0, 2, 64, bytes(71)),
        Err(QError::ByteLength {
            expected: 72,
            found: 71,
            ..
        })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_K, 1, 300, bytes(144)),
        Err(QError::NotBlockMultiple {
            block: 256,
            cols: 300,
            ..
        })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::Q2_K, 1, 256, bytes(84)),
        Err(QError::Unsupported(GgmlType::Q2_K))
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::F32, 0, 4, bytes(0)),
        Err(QError::Empty { .. })
    ));
    // rows · row_bytes overflows usize.
    assert!(matches!(
        QMatrix::new(GgmlType::F32, usize::MAX / 2, 4, bytes(16)),
        Err(QError::ByteLength { .. })
    ));
    let msg = QMatrix::new(GgmlType::Q6_K, 3, 256, bytes(10))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("Q6_K") && msg.contains("630") && msg.contains("10"),
        "{msg}"
    );
}

#[test]
fn stacking_rejects_mismatched_columns() {
    let a = QMatrix::new(GgmlType::F32, 1, 4, bytes(16)).unwrap();
    let b = QMatrix::new(GgmlType::F32, 1, 8, bytes(32)).unwrap();
    assert!(matches!(
        QWeight::new(vec![a, b]),
        Err(QError::ColsMismatch {
            first: 4,
            index: 1,
            found: 8
        })
    ));
    assert!(matches!(QWeight::new(vec![]), Err(QError::NoParts)));
}

#[test]
fn matmul_rejects_wrong_operand_lengths() {
    let w = QWeight::from(QMatrix::new(GgmlType::Q8_0, 3, 32, bytes(3 * 34)).unwrap());
    let mut y = vec![0f32; 6];
    assert!(w.matmul(&[0.0; 64], 2, &mut y).is_ok());
    assert!(matches!(
        w.matmul(&[0.0; 63], 2, &mut y),
        Err(QError::OperandLength {
            what: "x",
            found: 63,
            ..
        })
    ));
    assert!(matches!(
        w.matmul(&[0.0; 64], 2, &mut y[..5]),
        Err(QError::OperandLength {
            what: "y",
            found: 5,
            ..
        })
    ));
    // m · cols overflowing is a length error too, not a panic.
    assert!(w.matmul(&[0.0; 64], usize::MAX, &mut y).is_err());
    // m = 0 with empty operands is a no-op.
    assert!(w.matmul(&[], 0, &mut []).is_ok());
}

#[test]
fn dequantize_rows_into_checks_the_range() {
    let w = QWeight::from(QMatrix::new(GgmlType::F16, 3, 4, bytes(24)).unwrap());
    assert!(w.dequantize_rows_into(1, &mut [0.0; 8]).is_ok());
    assert!(matches!(
        w.dequantize_rows_into(2, &mut [0.0; 8]),
        Err(QError::RowRange {
            start: 2,
            end: 4,
            rows: 3
        })
    ));
    assert!(w.dequantize_rows_into(0, &mut [0.0; 5]).is_err());
    assert!(w.dequantize_rows_into(usize::MAX, &mut [0.0; 4]).is_err());
}

#[test]
fn from_gguf_wants_a_present_2d_tensor() {
    let mut wr = GgufWriter::new();
    wr.add_tensor_raw("vec", &[8], GgmlType::F32, vec![0u8; 32]);
    wr.add_tensor_raw("mat", &[32, 2], GgmlType::Q8_0, vec![0u8; 68]);
    wr.add_tensor_raw("cube", &[32, 2, 2], GgmlType::Q8_0, vec![0u8; 136]);
    let image = wr.to_bytes(Path::new("mem.gguf")).unwrap();
    let file = Arc::new(GgufFile::from_bytes("mem.gguf", image).unwrap());
    let m = QMatrix::from_gguf(&file, "mat").unwrap();
    assert_eq!(
        (m.ty(), m.rows(), m.cols(), m.bytes()),
        (GgmlType::Q8_0, 2, 32, 68)
    );
    assert!(matches!(
        QMatrix::from_gguf(&file, "vec"),
        Err(QError::Tensor { .. })
    ));
    assert!(matches!(
        QMatrix::from_gguf(&file, "cube"),
        Err(QError::Tensor { .. })
    ));
    assert!(matches!(
        QMatrix::from_gguf(&file, "nope"),
        Err(QError::Tensor { .. })
    ));
}

#[test]
fn non_finite_activations_do_not_panic() {
    use ridgefill_quant::{MatmulConfig, MatmulPath, SimdLevel};
    let w = QWeight::new(vec![
        QMatrix::new(GgmlType::Q8_0, 4, 256, bytes(4 * 8 * 34)).unwrap(),
        QMatrix::new(GgmlType::Q4_K, 4, 256, bytes(4 * 144)).unwrap(),
        QMatrix::new(GgmlType::F16, 4, 256, bytes(4 * 512)).unwrap(),
    ])
    .unwrap();
    let mut x = vec![1.0f32; 2 * 256];
    x[3] = f32::NAN;
    x[300] = f32::INFINITY;
    x[301] = f32::NEG_INFINITY;
    for level in SimdLevel::available() {
        for path in [MatmulPath::Integer, MatmulPath::DequantGemm] {
            let cfg = MatmulConfig {
                level,
                path,
                parallel: true,
            };
            let mut y = vec![0f32; 2 * 12];
            w.matmul_with(&cfg, &x, 2, &mut y).unwrap();
        }
    }
}
