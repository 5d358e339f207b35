//! Fused f32 kernels for the flex (CPU) backend.
//!
//! burn-flex runs elementwise ops on one thread and its attention scores and exponentiates every
//! causally masked entry; profiling pp512 put over a third of prefill there (docs/BENCHMARKS.md).
//! These kernels do the same maths row-parallel, skip the masked half, and leave every matmul to
//! `gemm`, the GEMM flex itself uses. The model calls them only when [`enabled`] says the device is
//! flex and the activations f32; everywhere else it runs the backend-free burn ops.

use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{DispatchDevice, Flex};
use burn::tensor::{Bytes, DType, Device, FloatDType, Shape, Tensor};
use ridgefill_quant::pool;
use std::env::VarError;

use crate::error::{ModelError, Result};

/// Elements below which a kernel stays on the calling thread (the pool's hand-off costs more).
const PARALLEL_MIN: usize = 1 << 15;
/// Q·Kᵀ multiply-adds below which attention stays on the calling thread (a decode step's).
const ATTENTION_PARALLEL_MIN: usize = 1 << 18;
/// Query rows per attention task: enough rows for an efficient GEMM, enough tasks to balance.
const QUERY_BLOCK: usize = 64;
/// Tasks per thread a parallel kernel's work is cut into (attention's query blocks, row chunks),
/// so a descheduled thread holds little work back.
const TASKS_PER_THREAD: usize = 4;
/// Query rows up to which attention runs as plain dot products (decode steps): packing the keys
/// for a GEMM costs more than the product itself.
const DOT_ROWS_MAX: usize = 4;

/// Environment variable that switches the fused kernels `off` (or `0`), to measure them against
/// the plain burn ops side by side; `on` (or `1`, or unset) leaves them where they apply.
pub const SWITCH: &str = "RIDGEFILL_CPU_KERNELS";

/// Whether the fused kernels apply: flex device, f32 activations and not switched off. A switch
/// value other than on/off is an error, not a silent default.
pub fn enabled(device: &Device, dtype: FloatDType) -> Result<bool> {
    let on = match std::env::var(SWITCH) {
        Err(VarError::NotPresent) => true,
        Ok(v) if matches!(v.as_str(), "on" | "1") => true,
        Ok(v) if matches!(v.as_str(), "off" | "0") => false,
        Ok(v) => return Err(bad_switch(&v)),
        Err(VarError::NotUnicode(v)) => return Err(bad_switch(&v.to_string_lossy())),
    };
    Ok(on && matches!(device.as_dispatch(), DispatchDevice::Flex(_)) && dtype == FloatDType::F32)
}

/// Environment variable choosing the fused path's KV cache storage: `f32` (or unset) or `f16`.
pub const KV_SWITCH: &str = "RIDGEFILL_KV_CACHE";

/// The KV storage [`KV_SWITCH`] asks for. f16 halves the bytes every decode step reads (at a few
/// hundred positions and several sequences as many as the weights) but moves logits past the
/// golden tests' tolerances against transformers, so f32 stays the default. A value other than
/// f16/f32 is an error.
pub fn kv_storage() -> Result<FloatDType> {
    match std::env::var(KV_SWITCH) {
        Err(VarError::NotPresent) => Ok(FloatDType::F32),
        Ok(v) if v == "f16" => Ok(FloatDType::F16),
        Ok(v) if v == "f32" => Ok(FloatDType::F32),
        Ok(v) => Err(bad_kv(&v)),
        Err(VarError::NotUnicode(v)) => Err(bad_kv(&v.to_string_lossy())),
    }
}

fn bad_kv(value: &str) -> ModelError {
    ModelError::Invalid(format!(
        "environment variable {KV_SWITCH}={value:?}: expected f16 or f32"
    ))
}

fn bad_switch(value: &str) -> ModelError {
    ModelError::Invalid(format!(
        "environment variable {SWITCH}={value:?}: expected on or off (1 or 0)"
    ))
}

/// The flex tensor behind `t`, copied to a contiguous layout unless `usable` accepts its own.
fn flex_with<const D: usize>(t: Tensor<D>, usable: impl Fn(&Layout) -> bool) -> FlexTensor {
    let t = t
        .try_into_primitive::<Flex>()
        .expect("cpu kernels are called only on flex tensors (see `enabled`)");
    if usable(t.layout()) {
        t
    } else {
        t.to_contiguous()
    }
}

/// The flex tensor behind `t` with unit inner stride, as the row kernels read it.
fn flex<const D: usize>(t: Tensor<D>) -> FlexTensor {
    flex_with(t, Layout::has_contiguous_inner)
}

/// A GEMM operand: any layout with non-negative strides as it is (a transposed view such as a
/// tied output head needs no copy), anything else made contiguous.
fn gemm_operand(t: Tensor<2>) -> FlexTensor {
    flex_with(t, |l| l.strides().iter().all(|&s| s >= 0))
}

fn wrap<const D: usize>(data: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    let layout = Layout::contiguous(Shape::from(shape.to_vec()));
    Tensor::from_primitive::<Flex>(FlexTensor::new(Bytes::from_elems(data), layout, DType::F32))
}

/// A 2-D f32 view with non-negative strides: storage from the first element, row and column
/// strides.
fn strided2(t: &FlexTensor) -> (&[f32], usize, usize) {
    let l = t.layout();
    let s = l.strides();
    (
        &t.storage::<f32>()[l.start_offset()..],
        s[0] as usize,
        s[1] as usize,
    )
}

/// A 2-D f32 view with unit inner stride (see [`flex`]): storage from the first element, row
/// stride.
fn rows2(t: &FlexTensor) -> (&[f32], usize) {
    let (s, row, _) = strided2(t);
    (s, row)
}

/// `[1, heads, rows, hd]` f32 rows as f16, for a narrow KV cache (half's slice conversion, which
/// uses F16C where the CPU has it; burn-flex's cast goes element by element).
pub fn narrow_kv(x: Tensor<4>) -> Tensor<4> {
    use half::slice::HalfFloatSliceExt;
    let dims = x.dims();
    let t = flex_with(x, Layout::is_contiguous);
    let src = &t.storage::<f32>()[t.layout().start_offset()..][..dims.iter().product()];
    let mut out = vec![half::f16::ZERO; src.len()];
    out.convert_from_f32_slice(src);
    let layout = Layout::contiguous(Shape::from(dims.to_vec()));
    Tensor::from_primitive::<Flex>(FlexTensor::new(Bytes::from_elems(out), layout, DType::F16))
}

/// An f16 `[1, heads, rows, hd]` view of a KV cache (rows contiguous within a head) widened to a
/// contiguous f32 tensor.
fn widen_kv(x: Tensor<4>) -> Tensor<4> {
    use half::slice::HalfFloatSliceExt;
    let [_, heads, rows, hd] = x.dims();
    let t = flex(x);
    let (src, head_stride, row_stride) = half::f16::view(&t);
    let mut out = vec![0f32; heads * rows * hd];
    for (h, dst) in out.chunks_exact_mut(rows * hd).enumerate() {
        let head = &src[h * head_stride..];
        if row_stride as usize == hd {
            head[..rows * hd].convert_to_f32_slice(dst);
        } else {
            for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
                head[r * row_stride as usize..][..hd].convert_to_f32_slice(d);
            }
        }
    }
    wrap(out, [1, heads, rows, hd])
}

/// A 4-D `[1, heads, rows, hd]` f32 view: storage from the first element, head and row strides.
fn heads4(x: &FlexTensor) -> (&[f32], usize, isize) {
    let l = x.layout();
    let s = l.strides();
    (&x.storage::<f32>()[l.start_offset()..], s[1] as usize, s[2])
}

/// [`heads4`] for the element types a KV cache is stored as.
trait KvView: Sized {
    fn view(x: &FlexTensor) -> (&[Self], usize, isize);
}

impl KvView for f32 {
    fn view(x: &FlexTensor) -> (&[f32], usize, isize) {
        heads4(x)
    }
}

impl KvView for half::f16 {
    fn view(x: &FlexTensor) -> (&[half::f16], usize, isize) {
        let l = x.layout();
        let s = l.strides();
        (
            &x.storage::<half::f16>()[l.start_offset()..],
            s[1] as usize,
            s[2],
        )
    }
}

/// Defines `fn $name` that runs its body compiled for AVX-512 or AVX2+FMA when the CPU has them,
/// so the body's loops vectorise wide whatever the build's target CPU.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($a: $t),*) {
            #[inline(always)]
            fn inner($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
                unsafe fn v4($($a: $t),*) {
                    inner($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($a: $t),*) {
                    inner($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has every feature `v4` enables (checked just above).
                    return unsafe { v4($($a),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above, for `v3`.
                    return unsafe { v3($($a),*) };
                }
            }
            inner($($a),*)
        }
    };
}

/// Accumulator lanes: independent partial results let the reductions below vectorise (f32
/// addition is not associative, so the compiler never reorders a single running sum).
const LANES: usize = 16;

#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let tail = chunks.remainder().iter();
    acc.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Keys ahead of the one being scored whose rows are prefetched: a decode step's K/V rows come
/// from memory (every other layer's cache and weights went through the caches since), and one
/// head's few hundred rows are too short a stream for the hardware prefetcher to ramp up.
const PREFETCH_KEYS: usize = 8;

/// Prefetches the cache lines of `xs[at..at + len]` (nothing past the end of `xs`).
#[inline(always)]
fn prefetch_row(xs: &[f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE_FLOATS: usize = 16;
        let end = (at + len).min(xs.len());
        let mut i = at;
        while i < end {
            // SAFETY: `i` is inside `xs`; a prefetch has no other effect.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    xs.as_ptr().add(i) as *const i8,
                )
            };
            i += LINE_FLOATS;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xs, at, len);
}

/// Columns of [`weighted_values`] summed in registers at once (four 16-float vectors).
const VALUE_GROUP: usize = 4 * LANES;

/// Σ of the lanes, pairwise (a running sum would be a chain of dependent scalar adds).
#[inline(always)]
fn tree_sum(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            a[l] += a[l + w];
        }
        w /= 2;
    }
    a[0]
}

/// Σ x².
#[inline(always)]
fn sum_squares(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += c[j] * c[j];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().map(|x| x * x).sum::<f32>()
}

/// Replaces each x by e^(x - shift) and returns their sum.
#[inline(always)]
fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            c[j] = exp(c[j] - shift);
            acc[j] += c[j];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for x in chunks.into_remainder() {
        *x = exp(*x - shift);
        sum += *x;
    }
    sum
}

simd_fn! {
    /// Normalises rows `r0..` of `xs` into `out` (whole rows of `d`).
    fn norm_rows(xs: &[f32], stride: usize, r0: usize, out: &mut [f32], w: &[f32], eps: f32) {
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
    fn swiglu_rows(gs: &[f32], stride: usize, r0: usize, out: &mut [f32], ff: usize) {
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
    fn rope_head(
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

simd_fn! {
    /// `scores[j] = scale · q·k_j` for keys `j < scores.len()`, key `j` at `ks[j·k_row..]`;
    /// value rows `vs[j·v_row..]` (read next, by [`weighted_values`]) are prefetched alongside.
    fn dot_scores(
        q: &[f32],
        ks: &[f32],
        k_row: usize,
        vs: &[f32],
        v_row: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let hd = q.len();
        for (j, s) in scores.iter_mut().enumerate() {
            prefetch_row(ks, (j + PREFETCH_KEYS) * k_row, hd);
            prefetch_row(vs, j * v_row, hd);
            let k = &ks[j * k_row..][..hd];
            let mut acc = [0f32; LANES];
            let mut kc = k.chunks_exact(LANES);
            let mut qc = q.chunks_exact(LANES);
            for (a, b) in (&mut qc).zip(&mut kc) {
                for l in 0..LANES {
                    acc[l] += a[l] * b[l];
                }
            }
            let tail: f32 = qc.remainder().iter().zip(kc.remainder()).map(|(a, b)| a * b).sum();
            *s = scale * (tree_sum(acc) + tail);
        }
    }
}

simd_fn! {
    /// `out = Σ_j p_j · v_j` over `p.len()` values, value `j` at `vs[j·v_row..]`.
    fn weighted_values(p: &[f32], vs: &[f32], v_row: usize, out: &mut [f32]) {
        let hd = out.len();
        let mut c0 = 0;
        // Columns in register-sized groups, two keys' sums interleaved, so the adds of one key
        // never wait on the previous key's (and `out` is not reloaded per key).
        while c0 + VALUE_GROUP <= hd {
            let mut acc = [[0f32; VALUE_GROUP]; 2];
            let mut pairs = p.chunks_exact(2);
            for (jp, w) in (&mut pairs).enumerate() {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let v = &vs[(2 * jp + u) * v_row + c0..][..VALUE_GROUP];
                    for l in 0..VALUE_GROUP {
                        acc[l] += w[u] * v[l];
                    }
                }
            }
            if let [w] = pairs.remainder() {
                let v = &vs[(p.len() - 1) * v_row + c0..][..VALUE_GROUP];
                for l in 0..VALUE_GROUP {
                    acc[0][l] += w * v[l];
                }
            }
            for l in 0..VALUE_GROUP {
                out[c0 + l] = acc[0][l] + acc[1][l];
            }
            c0 += VALUE_GROUP;
        }
        if c0 < hd {
            let out = &mut out[c0..];
            out.fill(0.0);
            for (j, &w) in p.iter().enumerate() {
                let v = &vs[j * v_row + c0..][..out.len()];
                for (o, &x) in out.iter_mut().zip(v) {
                    *o += w * x;
                }
            }
        }
    }
}

simd_fn! {
    /// Masked softmax over score rows of width `kv_end`; row `i` sees its first `live[i]` keys
    /// and the rest are zeroed.
    pub(crate) fn softmax_rows(scores: &mut [f32], kv_end: usize, live: &[usize]) {
        for (row, &seen) in scores.chunks_exact_mut(kv_end).zip(live) {
            let (live, masked) = row.split_at_mut(seen);
            let max = max_of(live);
            let inv = 1.0 / exp_shifted_sum(live, max);
            live.iter_mut().for_each(|s| *s *= inv);
            masked.fill(0.0);
        }
    }
}

simd_fn! {
    /// Replaces each x by e^(x - shift), vectorised (the sampler's weights over a vocabulary,
    /// which it sums in f64 itself).
    pub(crate) fn exp_shifted(xs: &mut [f32], shift: f32) {
        xs.iter_mut().for_each(|x| *x = exp(*x - shift));
    }
}

/// `e^x` to about 2 ulp (Cephes polynomial, branch-free so loops over it vectorise).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so `n·ln2` subtracts exactly.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n built from its exponent bits: ROUND + 127 + n holds n + 127 in its low mantissa bits
    // (a bit cast, where `n as i32` would saturate lane by lane and stop vectorisation).
    let biased = (n + (ROUND + 127.0))
        .to_bits()
        .wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(biased << 23)
}

/// Splits `out` into chunks of whole rows and runs `f(first_row, chunk)` on each, in parallel when
/// the work is large enough: on the quantised kernels' pool, whose threads are awake between
/// projections (a second pool's threads would compete with them for the cores).
fn for_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / row_len.max(1);
    if out.len() < PARALLEL_MIN || rows < 2 {
        f(0, out);
        return;
    }
    let per_task = rows.div_ceil(pool::threads() * TASKS_PER_THREAD).max(1);
    let chunk = per_task * row_len;
    let len = out.len();
    let base = SendPtr(out.as_mut_ptr());
    pool::for_each(len.div_ceil(chunk), &|t| {
        let start = t * chunk;
        // SAFETY: task t alone takes elements start..start + chunk of `out`, which outlives the
        // call (for_each returns after every task).
        let rows = unsafe {
            std::slice::from_raw_parts_mut(base.get().add(start), chunk.min(len - start))
        };
        f(t * per_task, rows)
    });
}

/// Multiply-adds below which a GEMM stays on the calling thread (burn-flex's own threshold).
const GEMM_PARALLEL_MIN: usize = 192 * 192 * 192;

/// `x · w`, plus `residual` when given, as one GEMM into a fresh buffer. burn-flex zeroes each
/// output and, when the allocator hands back memory short of its 64-byte alignment, copies it
/// once more; here the residual (or nothing) is the only write before the GEMM's.
fn gemm_into(x: Tensor<2>, w: &Tensor<2>, residual: Option<Tensor<2>>) -> Tensor<2> {
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

/// Matrix product with a weight held in GGUF blocks (`ridgefill-quant`), plus `residual` when
/// given.
///
/// # Shapes
/// - x: `[m, k]`, w: `[n, k]` blocks, residual: `[m, n]` → `[m, n]`
pub fn qmatmul(
    x: Tensor<2>,
    w: &ridgefill_quant::QWeight,
    residual: Option<Tensor<2>>,
) -> Tensor<2> {
    let [m, k] = x.dims();
    let n = w.rows();
    assert_eq!(k, w.cols(), "matmul inner dimensions");
    let x = flex_with(x, Layout::is_contiguous);
    let (xs, _) = rows2(&x);
    let mut out = vec![0.0f32; m * n];
    w.matmul(&xs[..m * k], m, &mut out)
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
fn gather_heads(
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
fn copy_head(
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

/// One sequence's share of [`attention_many`]: its queries `[1, heads, n, hd]`, its whole
/// K/V `[1, kv_heads, t, hd]` (t ≥ n), and `seen`: query row `i` sees the first `seen[i]` keys
/// (non-decreasing), or with `seen` empty the rows are the last `n` of `t` positions.
pub struct AttnItem {
    pub q: Tensor<4>,
    pub k: Tensor<4>,
    pub v: Tensor<4>,
    pub seen: Vec<usize>,
}

/// Causal grouped-query attention of one or more sequences, heads merged on output. Each task
/// takes one sequence's GQA group (the query heads sharing a K/V head) and block of query rows
/// and multiplies only the keys its rows see: prefill rows as two GEMMs with the group's heads
/// stacked, so each K/V head is packed once per block rather than once per query head; decode
/// rows through the group kernel. The tasks of all sequences share one parallel dispatch, where
/// one decode row's attention alone is too small to split.
///
/// # Shapes
/// - items: same heads and head size → `[Σ n, heads·hd]`, rows in order
pub fn attention_many(items: Vec<AttnItem>) -> Tensor<2> {
    struct Prep {
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        /// K and V are f16 (decode rows through the group kernel only).
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        half: bool,
        n: usize,
        seen: Vec<usize>,
        /// Decode rows (at most [`DOT_ROWS_MAX`]): dot products, not GEMMs.
        decode: bool,
        /// Query rows per block, and blocks.
        qblock: usize,
        blocks: usize,
        /// First output row.
        row0: usize,
        /// First task.
        job0: usize,
    }
    impl Prep {
        /// Query block `b`: its first row, the keys each of its rows sees, and the keys the
        /// block reads (its last row's).
        fn block(&self, b: usize) -> (usize, &[usize], usize) {
            let r0 = b * self.qblock;
            let live = &self.seen[r0..(r0 + self.qblock).min(self.n)];
            (r0, live, live[live.len() - 1])
        }
    }
    let [_, heads, _, hd] = items[0].q.dims();
    let kv_heads = items[0].k.dims()[1];
    let group = heads / kv_heads;
    let threads = pool::threads();
    let scale = 1.0 / (hd as f32).sqrt();
    let width = heads * hd;
    #[cfg(target_arch = "x86_64")]
    let group_kernel = crate::attn_x86::available(hd);
    #[cfg(not(target_arch = "x86_64"))]
    let group_kernel = false;
    let (mut rows, mut jobs, mut work) = (0, 0, 0);
    let preps: Vec<Prep> = items
        .into_iter()
        .map(|it| {
            let [_, h, n, d] = it.q.dims();
            let [_, kh, t, _] = it.k.dims();
            assert!(
                h == heads && d == hd && kh == kv_heads,
                "attention_many: items differ in heads"
            );
            let decode = n <= DOT_ROWS_MAX;
            // Blocks enough for every thread to get a few tasks, at most QUERY_BLOCK rows each.
            let want = (TASKS_PER_THREAD * threads).div_ceil(kv_heads);
            let qblock = n.div_ceil(want).clamp(DOT_ROWS_MAX + 1, QUERY_BLOCK);
            let blocks = n.div_ceil(qblock);
            let past = t - n;
            let seen = if it.seen.is_empty() {
                (0..n).map(|i| past + i + 1).collect()
            } else {
                it.seen
            };
            // Decode rows read an f16 cache in the group kernel; anything else widens it once.
            let half = it.k.dtype() == DType::F16;
            let direct = half && group_kernel && decode;
            let (k, v) = if half && !direct {
                (widen_kv(it.k), widen_kv(it.v))
            } else {
                (it.k, it.v)
            };
            let p = Prep {
                q: flex(it.q),
                k: flex(k),
                v: flex(v),
                half: direct,
                n,
                seen,
                decode,
                qblock,
                blocks,
                row0: rows,
                job0: jobs,
            };
            rows += n;
            jobs += kv_heads * blocks;
            work += heads * n * t * hd;
            p
        })
        .collect();
    let mut out = vec![0f32; rows * width];
    let out_ptr = SendPtr(out.as_mut_ptr());
    // A decode row of one head as dot products over the keys it sees.
    let one_head = |scores: &mut Vec<f32>, it: &Prep, h: usize, b: usize| {
        let (qs, q_head, q_row) = heads4(&it.q);
        let (ks, k_head, k_row) = heads4(&it.k);
        let (vs, v_head, v_row) = heads4(&it.v);
        let (r0, live, kv_end) = it.block(b);
        scores.resize(live.len() * kv_end, 0.0);
        let kh = h / group;
        // This task's first output element: row row0 + r0, head h.
        let out_at = (it.row0 + r0) * width + h * hd;
        let (k0, v0) = (&ks[kh * k_head..], &vs[kh * v_head..]);
        for (i, row) in scores.chunks_exact_mut(kv_end).enumerate() {
            let q = &qs[h * q_head + (r0 + i) * q_row as usize..][..hd];
            dot_scores(
                q,
                k0,
                k_row as usize,
                v0,
                v_row as usize,
                scale,
                &mut row[..live[i]],
            );
        }
        softmax_rows(scores, kv_end, live);
        for (i, row) in scores.chunks_exact(kv_end).enumerate() {
            let mut o = vec![0f32; hd];
            weighted_values(&row[..live[i]], v0, v_row as usize, &mut o);
            // SAFETY: each task writes its own head's columns of its own rows.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    o.as_ptr(),
                    out_ptr.get().add(out_at + i * width),
                    hd,
                );
            }
        }
    };
    // A block of rows of one GQA group as two GEMMs, the group's query heads stacked as rows
    // (head-major), so the K/V head is packed once for all of them.
    let group_gemm = |buf: &mut Scratch, it: &Prep, hg: usize, b: usize| {
        let (qs, q_head, q_row) = heads4(&it.q);
        let (ks, k_head, k_row) = heads4(&it.k);
        let (vs, v_head, v_row) = heads4(&it.v);
        let (r0, live, kv_end) = it.block(b);
        let rb = live.len();
        let m = group * rb;
        buf.q.clear();
        for h in hg * group..(hg + 1) * group {
            for i in r0..r0 + rb {
                buf.q
                    .extend_from_slice(&qs[h * q_head + i * q_row as usize..][..hd]);
            }
        }
        buf.scores.resize(m * kv_end, 0.0);
        buf.o.resize(m * hd, 0.0);
        buf.live.clear();
        (0..group).for_each(|_| buf.live.extend_from_slice(live));
        // SAFETY: K and V rows 0..kv_end of head hg lie inside their tensors' storage (the
        // caller's shapes), and the scratch buffers hold m·kv_end scores and m·hd outputs.
        unsafe {
            gemm::gemm(
                m,
                kv_end,
                hd,
                buf.scores.as_mut_ptr(),
                1,
                kv_end as isize,
                false,
                buf.q.as_ptr(),
                1,
                hd as isize,
                ks.as_ptr().add(hg * k_head),
                k_row,
                1,
                0.0,
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        softmax_rows(&mut buf.scores, kv_end, &buf.live);
        unsafe {
            gemm::gemm(
                m,
                hd,
                kv_end,
                buf.o.as_mut_ptr(),
                1,
                hd as isize,
                false,
                buf.scores.as_ptr(),
                1,
                kv_end as isize,
                vs.as_ptr().add(hg * v_head),
                1,
                v_row,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for (g, head) in buf.o.chunks_exact(rb * hd).enumerate() {
            let h = hg * group + g;
            for (i, o) in head.chunks_exact(hd).enumerate() {
                // SAFETY: each task writes its own group's columns of its own rows.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        o.as_ptr(),
                        out_ptr.get().add((it.row0 + r0 + i) * width + h * hd),
                        hd,
                    );
                }
            }
        }
    };
    // A decode task's GQA group through the hand-written kernel: each K/V row read once.
    #[cfg(target_arch = "x86_64")]
    let group_rows = |scores: &mut Vec<f32>, it: &Prep, hg: usize, b: usize| -> bool {
        if !group_kernel || !it.decode {
            return false;
        }
        let ctx = (group, hd, width, scale, out_ptr);
        if it.half {
            group_of_rows::<half::f16>(scores, it, hg, b, ctx);
        } else {
            group_of_rows::<f32>(scores, it, hg, b, ctx);
        }
        true
    };
    // One task's rows of one GQA group, K/V of either element type.
    #[cfg(target_arch = "x86_64")]
    fn group_of_rows<E: crate::attn_x86::KvElem + KvView>(
        scores: &mut Vec<f32>,
        it: &Prep,
        hg: usize,
        b: usize,
        (group, hd, width, scale, out_ptr): (usize, usize, usize, f32, SendPtr),
    ) {
        let (qs, q_head, q_row) = heads4(&it.q);
        let (ks, k_head, k_row) = E::view(&it.k);
        let (vs, v_head, v_row) = E::view(&it.v);
        assert!(
            k_row > 0 && v_row > 0,
            "attention_many: K/V rows must be laid out forwards"
        );
        let (r0, rows, _) = it.block(b);
        let (k0, v0) = (&ks[hg * k_head..], &vs[hg * v_head..]);
        for (i, &live) in rows.iter().enumerate() {
            assert!(
                live >= 1 && (live - 1) * k_row as usize + hd <= k0.len(),
                "attention_many: row sees {live} keys past the cache"
            );
            assert!((live - 1) * v_row as usize + hd <= v0.len());
            let q: Vec<&[f32]> = (hg * group..(hg + 1) * group)
                .map(|h| &qs[h * q_head + (r0 + i) * q_row as usize..][..hd])
                .collect();
            let at = (it.row0 + r0 + i) * width + hg * group * hd;
            // SAFETY: this task alone writes its rows' columns of its group's heads.
            let row = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), group * hd) };
            let mut outs: Vec<&mut [f32]> = row.chunks_exact_mut(hd).collect();
            // SAFETY: `available(hd)` checked; keys and values j < live are inside k0 / v0
            // (asserted above).
            unsafe {
                crate::attn_x86::group_row(
                    &q,
                    k0.as_ptr(),
                    k_row as usize,
                    v0.as_ptr(),
                    v_row as usize,
                    live,
                    scale,
                    scores,
                    &mut outs,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let group_rows = |_: &mut Vec<f32>, _: &Prep, _: usize, _: usize| false;
    let task = |buf: &mut Scratch, job: usize| {
        let it = &preps[preps.partition_point(|p| p.job0 <= job) - 1];
        let j = job - it.job0;
        let (hg, b) = (j / it.blocks, j % it.blocks);
        if group_rows(&mut buf.scores, it, hg, b) {
            return;
        }
        let (k_row, v_row) = (it.k.layout().strides()[2], it.v.layout().strides()[2]);
        if it.decode && k_row > 0 && v_row > 0 {
            for h in hg * group..(hg + 1) * group {
                one_head(&mut buf.scores, it, h, b);
            }
        } else {
            group_gemm(buf, it, hg, b);
        }
    };
    // Each thread keeps its buffers (scores are rows × keys: megabytes at long prompts).
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
    }
    let run = |j: usize| SCRATCH.with(|b| task(&mut b.borrow_mut(), j));
    if work < ATTENTION_PARALLEL_MIN {
        (0..jobs).for_each(run);
    } else {
        pool::for_each(jobs, &run);
    }
    wrap(out, [rows, width])
}

/// One attention task's buffers, kept per thread across tasks and calls.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    /// A GQA group's query rows, stacked.
    q: Vec<f32>,
    /// Their outputs, before they go to their heads' columns.
    o: Vec<f32>,
    /// Keys seen by each stacked row.
    live: Vec<usize>,
}

/// A raw output pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint regions, and the buffer outlives them (all join before it is read).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    #[test]
    fn exp_is_within_a_few_ulp_of_std() {
        const STEPS: usize = 100_000;
        let (lo, hi) = (-87.0f32, 88.0f32);
        for i in 0..=STEPS {
            let x = lo + (hi - lo) * i as f32 / STEPS as f32;
            let (got, want) = (exp(x), x.exp());
            let rel = ((got - want) / want).abs();
            assert!(rel < 4.0 * f32::EPSILON, "exp({x}) = {got}, std {want}");
        }
        // Far below the range: clamped to a tiny positive value, never NaN or a negative.
        let tiny = exp(-1.0e4);
        assert!((0.0..1e-37).contains(&tiny), "exp(-1e4) = {tiny}");
    }

    /// Naive attention of one query row against the first `live` keys of one K/V head.
    fn naive_row(q: &[f32], k: &[f32], v: &[f32], hd: usize, live: usize) -> Vec<f32> {
        let scale = 1.0 / (hd as f32).sqrt();
        let s: Vec<f64> = (0..live)
            .map(|j| (0..hd).map(|d| (q[d] * k[j * hd + d]) as f64).sum::<f64>() * scale as f64)
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        (0..hd)
            .map(|d| {
                (0..live)
                    .map(|j| (s[j] - m).exp() / z * v[j * hd + d] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    }

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

    #[test]
    fn attention_rows_match_naive() {
        for half in [false, true] {
            attention_matches_naive(half);
        }
    }

    /// Decode rows (the group kernel) and prefill rows (an f16 cache widened first) against a
    /// naive attention over the same (rounded) K/V.
    fn attention_matches_naive(half: bool) {
        let device = Device::flex();
        let (heads, kv_heads) = (9, 3);
        let round = |x: Vec<f32>| -> Vec<f32> {
            if half {
                x.into_iter()
                    .map(|v| half::f16::from_f32(v).to_f32())
                    .collect()
            } else {
                x
            }
        };
        let to_kv = |x: Vec<f32>, shape: [usize; 4]| {
            let t = Tensor::<4>::from_data(TensorData::new(x, shape), &device);
            if half { t.cast(FloatDType::F16) } else { t }
        };
        for hd in [64, 128, 48] {
            // Cache lengths around the 16-key blocks, sequences batched into one call.
            let lens = [1usize, 15, 16, 17, 40];
            let mut seed = 7u32;
            let mut rnd = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
                    })
                    .collect()
            };
            let data: Vec<_> = lens
                .iter()
                .map(|&t| {
                    (
                        rnd(heads * hd),
                        round(rnd(kv_heads * t * hd)),
                        round(rnd(kv_heads * t * hd)),
                    )
                })
                .collect();
            let items = data
                .iter()
                .zip(lens)
                .map(|((q, k, v), t)| AttnItem {
                    q: Tensor::from_data(TensorData::new(q.clone(), [1, heads, 1, hd]), &device),
                    k: to_kv(k.clone(), [1, kv_heads, t, hd]),
                    v: to_kv(v.clone(), [1, kv_heads, t, hd]),
                    seen: Vec::new(),
                })
                .collect();
            let got = attention_many(items)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            for (s, ((q, k, v), t)) in data.iter().zip(lens).enumerate() {
                for h in 0..heads {
                    let kh = h / (heads / kv_heads);
                    let want = naive_row(
                        &q[h * hd..][..hd],
                        &k[kh * t * hd..][..t * hd],
                        &v[kh * t * hd..][..t * hd],
                        hd,
                        t,
                    );
                    let row = &got[s * heads * hd + h * hd..][..hd];
                    for (d, (a, b)) in row.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() < 1e-4,
                            "half {half} hd {hd} seq {s} head {h} col {d}: {a} vs {b}"
                        );
                    }
                }
            }
            // Prefill rows (past the decode kernel's row count): the last `n` of `t` positions,
            // and rows at scattered positions (an exact pass) over more than one query block.
            let scattered: Vec<usize> = (0..130).map(|i| i * 2 + i % 3).chain([299]).collect();
            for (n, t, seen) in [
                (DOT_ROWS_MAX + 3, 21, Vec::new()),
                (
                    scattered.len(),
                    300,
                    scattered.iter().map(|p| p + 1).collect(),
                ),
            ] {
                let q = rnd(heads * n * hd);
                let (k, v) = (round(rnd(kv_heads * t * hd)), round(rnd(kv_heads * t * hd)));
                let live = |i: usize| seen.get(i).copied().unwrap_or(t - n + i + 1);
                let item = AttnItem {
                    q: Tensor::from_data(TensorData::new(q.clone(), [1, heads, n, hd]), &device),
                    k: to_kv(k.clone(), [1, kv_heads, t, hd]),
                    v: to_kv(v.clone(), [1, kv_heads, t, hd]),
                    seen: seen.clone(),
                };
                let got = attention_many(vec![item])
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap();
                for i in 0..n {
                    for h in 0..heads {
                        let kh = h / (heads / kv_heads);
                        let want = naive_row(
                            &q[(h * n + i) * hd..][..hd],
                            &k[kh * t * hd..][..t * hd],
                            &v[kh * t * hd..][..t * hd],
                            hd,
                            live(i),
                        );
                        let row = &got[i * heads * hd + h * hd..][..hd];
                        for (d, (a, b)) in row.iter().zip(&want).enumerate() {
                            assert!(
                                (a - b).abs() < 1e-4,
                                "prefill half {half} hd {hd} n {n} row {i} head {h} col {d}: \
                                 {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_rows_are_causal_and_sum_to_one() {
        let (rows, width, seen0) = (3, 5, 2);
        let mut s: Vec<f32> = (0..rows * width).map(|i| (i % 7) as f32 * 0.5).collect();
        let orig = s.clone();
        let live: Vec<usize> = (0..rows).map(|r| seen0 + r).collect();
        softmax_rows(&mut s, width, &live);
        for r in 0..rows {
            let row = &s[r * width..][..width];
            let live = seen0 + r;
            assert!(row[live..].iter().all(|&x| x == 0.0), "row {r}: {row:?}");
            let o = &orig[r * width..][..live];
            let m = o.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = o.iter().map(|x| (x - m).exp()).sum();
            for (j, &x) in row[..live].iter().enumerate() {
                let want = (o[j] - m).exp() / z;
                assert!((x - want).abs() < 1e-6, "row {r} col {j}: {x} vs {want}");
            }
        }
    }
}
