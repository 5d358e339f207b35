//! Dense and quantised GEMMs on flex tensors: `gemm` (the GEMM flex itself uses) without
//! burn-flex's extra output passes, and the GGUF-block kernels of `ridgefill-quant`.

use burn::backend::flex::Layout;
use burn::tensor::Tensor;

use super::flex::{flex, flex_with, gemm_operand, rows2, strided2, wrap};

/// Multiply-adds below which a GEMM stays on the calling thread (burn-flex's own threshold).
pub(crate) const GEMM_PARALLEL_MIN: usize = 192 * 192 * 192;

/// `x · w`, plus `residual` when given, as one GEMM into a fresh buffer. burn-flex zeroes each
/// output and, when the allocator hands back memory short of its 64-byte alignment, copies it
/// once more; here the residual (or nothing) is the only write before the GEMM's.
pub(crate) fn gemm_into(x: Tensor<2>, w: &Tensor<2>, residual: Option<Tensor<2>>) -> Tensor<2> {
    let [m, k] = x.dims();
    let [k2, n] = w.dims();
    assert_eq!(k, k2, "matmul inner dimensions");
    if m * n * k == 0 {
        let p = x.matmul(w.clone());
        return match residual {
            Some(r) => r + p,
            None => p,
        };
    }
    let (x, w) = (gemm_operand(x), gemm_operand(w.clone()));
    let (xs, x_rs, x_cs) = strided2(&x);
    let (ws, w_rs, w_cs) = strided2(&w);
    let mut out: Vec<f32> = match residual {
        Some(r) => {
            let r = flex(r);
            let (rs, r_row) = rows2(&r);
            let mut out = Vec::with_capacity(m * n);
            (0..m).for_each(|i| out.extend_from_slice(&rs[i * r_row..][..n]));
            out
        }
        None => Vec::with_capacity(m * n),
    };
    let accumulate = !out.is_empty();
    let parallelism = if m * n * k >= GEMM_PARALLEL_MIN {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    assert!(
        xs.len() > (m - 1) * x_rs + (k - 1) * x_cs && ws.len() > (k - 1) * w_rs + (n - 1) * w_cs,
        "GEMM operand extents"
    );
    // SAFETY: the operands' extents are checked just above; `out` has room for m·n elements and
    // the GEMM writes every one of them (reading them first only when they hold the residual).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            xs.as_ptr(),
            x_cs as isize,
            x_rs as isize,
            ws.as_ptr(),
            w_cs as isize,
            w_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        out.set_len(m * n);
    }
    wrap(out, [m, n])
}

/// Matrix product.
///
/// # Shapes
/// - x: `[m, k]`, w: `[k, n]` → `[m, n]`
pub fn matmul(x: Tensor<2>, w: &Tensor<2>) -> Tensor<2> {
    gemm_into(x, w, None)
}

/// Matrix product added to a residual stream.
///
/// # Shapes
/// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
pub fn matmul_add(x: Tensor<2>, w: &Tensor<2>, residual: Tensor<2>) -> Tensor<2> {
    assert_eq!(
        residual.dims(),
        [x.dims()[0], w.dims()[1]],
        "residual shape"
    );
    gemm_into(x, w, Some(residual))
}

/// Matrix product with a weight held in GGUF blocks (`ridgefill-quant`) by `path`, plus
/// `residual` when given.
///
/// # Shapes
/// - x: `[m, k]`, w: `[n, k]` blocks, residual: `[m, n]` → `[m, n]`
pub fn qmatmul(
    x: Tensor<2>,
    w: &ridgefill_quant::QWeight,
    residual: Option<Tensor<2>>,
    path: ridgefill_quant::MatmulPath,
) -> Tensor<2> {
    let [m, k] = x.dims();
    let n = w.rows();
    assert_eq!(k, w.cols(), "matmul inner dimensions");
    let x = flex_with(x, Layout::is_contiguous);
    let (xs, _) = rows2(&x);
    let mut out = vec![0.0f32; m * n];
    let cfg = ridgefill_quant::MatmulConfig {
        path,
        ..Default::default()
    };
    w.matmul_with(&cfg, &xs[..m * k], m, &mut out)
        .expect("operand sizes checked above");
    if let Some(r) = residual {
        assert_eq!(r.dims(), [m, n], "residual shape");
        let r = flex(r);
        let (rs, r_row) = rows2(&r);
        for (i, row) in out.chunks_exact_mut(n).enumerate() {
            row.iter_mut()
                .zip(&rs[i * r_row..][..n])
                .for_each(|(o, r)| *o += r);
        }
    }
    wrap(out, [m, n])
}
