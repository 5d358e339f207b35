//! Row kernels: RMSNorm, SwiGLU, RoPE of the fused Q/K/V projection, and the fill's K/V written
//! (keys rotated at their own positions) straight into the cache storage.

use burn::backend::Flex;
use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::Tensor;

use super::flex::{flex, flex_with, rows2, wrap};
use super::par::for_rows;
use super::simd::{exp, simd_fn, sum_squares};

simd_fn! {
    /// Normalises rows `r0..` of `xs` into `out` (whole rows of `d`).
    pub(crate) fn norm_rows(xs: &[f32], stride: usize, r0: usize, out: &mut [f32], w: &[f32], eps: f32) {
        let d = w.len();
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            let row = &xs[(r0 + i) * stride..][..d];
            let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
                *o = v * inv * w;
            }
        }
    }
}

simd_fn! {
    /// `silu(gate) · up` for rows `r0..` of `gs` (gate columns then up columns) into `out`.
    pub(crate) fn swiglu_rows(gs: &[f32], stride: usize, r0: usize, out: &mut [f32], ff: usize) {
        for (i, o) in out.chunks_exact_mut(ff).enumerate() {
            let (gate, up) = gs[(r0 + i) * stride..][..2 * ff].split_at(ff);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + exp(-g)) * u;
            }
        }
    }
}

simd_fn! {
    /// Rotates one head (`[n, hd]` in `out`) read from columns `col..col+hd` of `xs`, rows at
    /// positions `pos..`; cos/sin are `[positions, hd]` tables.
    pub(crate) fn rope_head(
        xs: &[f32],
        stride: usize,
        col: usize,
        out: &mut [f32],
        hd: usize,
        cos: &[f32],
        sin: &[f32],
        pos: usize,
        at: &[usize],
    ) {
        let half = hd / 2;
        for (i, o) in out.chunks_exact_mut(hd).enumerate() {
            let x = &xs[i * stride + col..][..hd];
            let p = if at.is_empty() { pos + i } else { at[i] };
            let c = &cos[p * hd..][..hd];
            let s = &sin[p * hd..][..hd];
            let (o1, o2) = o.split_at_mut(half);
            let (x1, x2) = x.split_at(half);
            let ((c1, c2), (s1, s2)) = (c.split_at(half), s.split_at(half));
            for (j, o) in o1.iter_mut().enumerate() {
                *o = x1[j] * c1[j] - x2[j] * s1[j];
            }
            for (j, o) in o2.iter_mut().enumerate() {
                *o = x2[j] * c2[j] + x1[j] * s2[j];
            }
        }
    }
}

/// RMSNorm with a weight, computed as Hugging Face does in f32: `x / sqrt(mean(x²) + eps) · w`.
///
/// # Shapes
/// - x: `[n, d]`, weight: `[d]` → `[n, d]`
pub fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Tensor<2> {
    let [n, d] = x.dims();
    let x = flex(x);
    let w = flex(weight.clone());
    let (xs, stride) = rows2(&x);
    let ws = &w.storage::<f32>()[w.layout().start_offset()..][..d];
    let eps = eps as f32;
    let mut out = vec![0f32; n * d];
    for_rows(&mut out, d, |r0, chunk| {
        norm_rows(xs, stride, r0, chunk, ws, eps)
    });
    wrap(out, [n, d])
}

/// SwiGLU: `silu(gate) · up` over the fused gate/up projection's output.
///
/// # Shapes
/// - gate_up: `[n, 2·ff]` (gate columns then up columns) → `[n, ff]`
pub fn swiglu(gate_up: Tensor<2>) -> Tensor<2> {
    let [n, two_ff] = gate_up.dims();
    let ff = two_ff / 2;
    let g = flex(gate_up);
    let (gs, stride) = rows2(&g);
    let mut out = vec![0f32; n * ff];
    for_rows(&mut out, ff, |r0, chunk| {
        swiglu_rows(gs, stride, r0, chunk, ff)
    });
    wrap(out, [n, ff])
}

/// Rotate-half RoPE at positions `pos..` (or at `at[i]` for row `i` when `at` is not empty):
/// host `[positions, hd]` cos and sin tables.
#[derive(Clone, Copy)]
pub struct Rotation<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub pos: usize,
    pub at: &'a [usize],
}

/// Gathers `count` heads of `hd` columns out of `x` (output head `j` is input head `src(j)`),
/// rotating them when `rope` is given, in one row-parallel pass.
///
/// # Shapes
/// - x: `[n, heads_in·hd]` → `[count, n, hd]` (flat)
pub(crate) fn gather_heads(
    x: &FlexTensor,
    n: usize,
    hd: usize,
    count: usize,
    src: impl Fn(usize) -> usize + Sync,
    rope: Option<Rotation>,
) -> Vec<f32> {
    let (xs, stride) = rows2(x);
    let mut out = vec![0f32; count * n * hd];
    for_rows(&mut out, n * hd, |h0, chunk| {
        for (i, head) in chunk.chunks_exact_mut(n * hd).enumerate() {
            copy_head(xs, stride, src(h0 + i) * hd, 0, head, hd, rope.as_ref());
        }
    });
    out
}

/// Rows `r0..` of the head at columns `col..col + hd` of `xs` into `out` (`[rows, hd]`), rotated
/// at their positions when `rope` is given.
pub(crate) fn copy_head(
    xs: &[f32],
    stride: usize,
    col: usize,
    r0: usize,
    out: &mut [f32],
    hd: usize,
    rope: Option<&Rotation>,
) {
    match rope {
        Some(r) => rope_head(
            &xs[r0 * stride..],
            stride,
            col,
            out,
            hd,
            r.cos,
            r.sin,
            r.pos + r0,
            r.at.get(r0..).unwrap_or(&[]),
        ),
        None => out.chunks_exact_mut(hd).enumerate().for_each(|(i, o)| {
            o.copy_from_slice(&xs[(r0 + i) * stride + col..][..hd]);
        }),
    }
}

/// Splits the fused QKV projection into heads and rotates Q and K (rotate-half RoPE) at positions
/// `pos..pos+n`; V is only regrouped by head.
///
/// # Shapes
/// - qkv: `[n, (heads + 2·kv_heads)·hd]` → q `[1, heads, n, hd]`, k and v `[1, kv_heads, n, hd]`
pub fn qkv_rope(
    qkv: Tensor<2>,
    heads: usize,
    kv_heads: usize,
    rope: Rotation,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let [n, width] = qkv.dims();
    let hd = width / (heads + 2 * kv_heads);
    let x = flex(qkv);
    let q = gather_heads(&x, n, hd, heads, |j| j, Some(rope));
    let k = gather_heads(&x, n, hd, kv_heads, |j| heads + j, Some(rope));
    let v = gather_heads(&x, n, hd, kv_heads, |j| heads + kv_heads + j, None);
    (
        wrap(q, [1, heads, n, hd]),
        wrap(k, [1, kv_heads, n, hd]),
        wrap(v, [1, kv_heads, n, hd]),
    )
}

/// [`fill_kv`] of layer `layer` of `y` written straight into a cache layer's f32 storage at
/// slots `at..at + b`: no intermediate K/V tensors and no second copy.
///
/// # Shapes
/// - y: `[b, layers·2·kv_heads·hd]`; k_cache, v_cache: `[1, kv_heads, capacity, hd]` f32
pub fn fill_kv_into(
    y: &Tensor<2>,
    layer: usize,
    rope: Rotation,
    (k_cache, v_cache): (Tensor<4>, Tensor<4>),
    at: usize,
) -> (Tensor<4>, Tensor<4>) {
    let b = y.dims()[0];
    let x = flex(y.clone());
    let (xs, stride) = rows2(&x);
    let write = |cache: Tensor<4>, part: usize, rope: Option<&Rotation>| {
        let [_, kv_heads, capacity, hd] = cache.dims();
        assert!(at + b <= capacity, "fill_kv_into: slots past the cache");
        let mut c = flex_with(cache, Layout::is_contiguous);
        let start = c.layout().start_offset();
        let storage = &mut c.storage_mut::<f32>()[start..][..kv_heads * capacity * hd];
        storage
            .chunks_exact_mut(capacity * hd)
            .enumerate()
            .for_each(|(j, head)| {
                let col = ((layer * 2 + part) * kv_heads + j) * hd;
                let rows = &mut head[at * hd..(at + b) * hd];
                for_rows(rows, hd, |r0, rows| {
                    copy_head(xs, stride, col, r0, rows, hd, rope)
                });
            });
        Tensor::from_primitive::<Flex>(c)
    };
    (write(k_cache, 0, Some(&rope)), write(v_cache, 1, None))
}

/// Splits the fill GEMM's output into every upper layer's K (rotated at positions `pos..`) and V.
///
/// # Shapes
/// - y: `[b, layers·2·kv_heads·hd]` (per layer: K heads, then V heads)
///   → k and v `[layers, kv_heads, b, hd]`
pub fn fill_kv(
    y: Tensor<2>,
    layers: usize,
    kv_heads: usize,
    hd: usize,
    rope: Rotation,
) -> (Tensor<4>, Tensor<4>) {
    let b = y.dims()[0];
    let x = flex(y);
    let count = layers * kv_heads;
    let src = |j: usize, part: usize| (j / kv_heads * 2 + part) * kv_heads + j % kv_heads;
    let k = gather_heads(&x, b, hd, count, |j| src(j, 0), Some(rope));
    let v = gather_heads(&x, b, hd, count, |j| src(j, 1), None);
    let shape = [layers, kv_heads, b, hd];
    (wrap(k, shape), wrap(v, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn fill_written_into_the_cache_equals_fill_kv() {
        let device = Device::flex();
        let (layers, kv_heads, hd, b, cap, at, pos) = (2, 3, 8, 5, 12, 4, 6);
        let width = layers * 2 * kv_heads * hd;
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let y = Tensor::<2>::from_data(TensorData::new(wave(b * width, 0.37), [b, width]), &device);
        let (cos, sin) = (wave(16 * hd, 0.11), wave(16 * hd, 0.23));
        let rope = || Rotation {
            cos: &cos,
            sin: &sin,
            pos,
            at: &[],
        };
        let (k_want, v_want) = fill_kv(y.clone(), layers, kv_heads, hd, rope());
        let (k_want, v_want) = (to_vec(k_want), to_vec(v_want));
        for layer in 0..layers {
            let empty = || Tensor::<4>::zeros([1, kv_heads, cap, hd], &device);
            let (k, v) = fill_kv_into(&y, layer, rope(), (empty(), empty()), at);
            for (got, want, what) in [(to_vec(k), &k_want, "K"), (to_vec(v), &v_want, "V")] {
                for j in 0..kv_heads {
                    for slot in 0..cap {
                        let got = &got[(j * cap + slot) * hd..][..hd];
                        if (at..at + b).contains(&slot) {
                            let r = slot - at;
                            let want = &want[((layer * kv_heads + j) * b + r) * hd..][..hd];
                            assert_eq!(got, want, "{what} layer {layer} head {j} slot {slot}");
                        } else {
                            assert!(got.iter().all(|&x| x == 0.0), "{what} slot {slot} written");
                        }
                    }
                }
            }
        }
    }

    fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }
}
