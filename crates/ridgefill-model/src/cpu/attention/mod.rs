//! Causal grouped-query attention on flex tensors: prefill rows as GEMMs over each GQA group's
//! stacked query heads, a few prefill rows over a long cache (a follow-up turn) through the x86
//! few-rows kernel, decode rows as dot products (or the x86 group kernel), every sequence's
//! tasks in one parallel dispatch; masked entries are never scored.

mod received;
mod split;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use received::attention_received;

use std::ops::Range;

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Tensor};
use ridgefill_quant::pool;

#[cfg(target_arch = "x86_64")]
use super::flex::KvView;
use super::flex::{flex, heads4, widen_kv, wrap};
use super::par::{SendPtr, TASKS_PER_THREAD};
use super::simd::{
    LANES, PREFETCH_KEYS, VALUE_GROUP, prefetch_row, simd_fn, softmax_rows, tree_sum,
};

/// Q·Kᵀ multiply-adds below which attention stays on the calling thread (a decode step's).
pub(crate) const ATTENTION_PARALLEL_MIN: usize = 1 << 18;
/// Query rows per attention task: enough rows for an efficient GEMM, enough tasks to balance.
pub(crate) const QUERY_BLOCK: usize = 64;
/// Query rows up to which attention runs as plain dot products (decode steps): packing the keys
/// for a GEMM costs more than the product itself.
pub(crate) const DOT_ROWS_MAX: usize = 4;

/// Stacked query rows (GQA group × new rows) up to which prefill rows go to the few-rows kernel
/// (x86 with AVX-512) rather than the GEMMs: a follow-up turn's question over a long cache.
const FEW_ROWS_MAX: usize = 128;

/// A task's cost beyond its query rows, in rows: its setup and the K/V packing every task
/// repeats (fitted on 2 AVX2 threads, 8–100 rows over 800–3000 keys).
const TASK_OVERHEAD_ROWS: usize = 1;

/// Query rows per block of one sequence's prefill rows, row `i` seeing `seen[i]` keys. Rows
/// that see about as many keys as each other (a follow-up over a long cache) cost alike, so
/// the block count is the one whose `kv_heads · blocks` tasks finish soonest on `threads`
/// threads: 19 rows over 3000 keys as 2 blocks a K/V head (6 tasks on 2 threads) ran in 1.4 ms
/// a layer against 1.6 as 3 (9 tasks, the last thread's one alone). A fresh prompt's causal rows
/// cost more the later they are, so there several smaller tasks a thread balance instead.
fn query_block(seen: &[usize], kv_heads: usize, threads: usize) -> usize {
    let n = seen.len();
    let alike = seen[0] * 2 >= seen[n - 1];
    if !alike {
        let want = (TASKS_PER_THREAD * threads).div_ceil(kv_heads);
        return n.div_ceil(want).clamp(DOT_ROWS_MAX + 1, QUERY_BLOCK);
    }
    let fewest = n.div_ceil(QUERY_BLOCK);
    let most = (n / (DOT_ROWS_MAX + 1)).max(fewest);
    let finish = |b: usize| (kv_heads * b).div_ceil(threads) * (n.div_ceil(b) + TASK_OVERHEAD_ROWS);
    let blocks = (fewest..=most).min_by_key(|&b| finish(b)).unwrap_or(fewest);
    n.div_ceil(blocks)
}

simd_fn! {
    /// `scores[j] = scale · q·k_j` for keys `j < scores.len()`, key `j` at `ks[j·k_row..]`;
    /// value rows `vs[j·v_row..]` (read next, by [`weighted_values`]) are prefetched alongside.
    pub(crate) fn dot_scores(
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
    pub(crate) fn weighted_values(p: &[f32], vs: &[f32], v_row: usize, out: &mut [f32]) {
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
/// stacked, so each K/V head is packed once per block rather than once per query head; up to
/// [`FEW_ROWS_MAX`] stacked rows through the few-rows kernel, a head's keys split among tasks;
/// decode rows through the group kernel. The tasks of all sequences share one parallel dispatch, where
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
        /// A few prefill rows: the few-rows kernel, keys split into chunks like decode rows'.
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        few: bool,
        /// Query rows per block, and blocks.
        qblock: usize,
        blocks: usize,
        /// Decode and few rows: chunks of keys per K/V head (merged after the tasks), keys per
        /// chunk, and the first of this sequence's rows' softmax parts.
        chunks: usize,
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        chunk_keys: usize,
        part0: usize,
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
    let group_kernel = x86::available(hd);
    #[cfg(not(target_arch = "x86_64"))]
    let group_kernel = false;
    #[cfg(target_arch = "x86_64")]
    let (few_kernel, few_rows_max) = (x86::block_available(hd), x86::BLOCK_ROWS_MAX);
    #[cfg(not(target_arch = "x86_64"))]
    let (few_kernel, few_rows_max) = (false, 1);
    let (mut rows, mut jobs, mut work, mut part_rows) = (0, 0, 0, 0);
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
            let past = t - n;
            let seen: Vec<usize> = if it.seen.is_empty() {
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
            let (k, v) = (flex(k), flex(v));
            let keys = seen[n - 1];
            let forwards = k.layout().strides()[2] > 0 && v.layout().strides()[2] > 0;
            let few = few_kernel && !decode && forwards && group * n <= FEW_ROWS_MAX;
            let (qblock, chunks) = if few {
                // Blocks of stacked rows that fit the kernel, keys split to fill the threads.
                let qblock = n.div_ceil((group * n).div_ceil(few_rows_max));
                let blocks = n.div_ceil(qblock);
                (qblock, split::key_chunks(keys, kv_heads * blocks, threads))
            } else if group_kernel && decode {
                (
                    query_block(&seen, kv_heads, threads),
                    split::key_chunks(keys, kv_heads, threads),
                )
            } else {
                (query_block(&seen, kv_heads, threads), 1)
            };
            let blocks = n.div_ceil(qblock);
            let p = Prep {
                q: flex(it.q),
                k,
                v,
                half: direct,
                n,
                seen,
                decode,
                few,
                qblock,
                blocks,
                row0: rows,
                job0: jobs,
                chunks,
                chunk_keys: keys.div_ceil(chunks),
                part0: part_rows,
            };
            rows += n;
            jobs += kv_heads * blocks * chunks;
            if chunks > 1 {
                part_rows += n;
            }
            work += heads * n * t * hd;
            p
        })
        .collect();
    let mut out = vec![0f32; rows * width];
    let out_ptr = SendPtr(out.as_mut_ptr());
    // Split decode rows' softmax parts: per row, head and chunk, one `split::slot_len` slot.
    let chunks_max = preps.iter().map(|p| p.chunks).max().unwrap_or(1);
    let slot = split::slot_len(hd);
    let mut parts = vec![0f32; part_rows * heads * chunks_max * slot];
    // Written only by the x86 group kernels (elsewhere every sequence keeps one chunk).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    let parts_ptr = SendPtr(parts.as_mut_ptr());
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
    // A block's stacked outputs (head-major) to their heads' columns of their rows.
    let scatter = |o: &[f32], it: &Prep, hg: usize, r0: usize, rb: usize| {
        for (g, head) in o.chunks_exact(rb * hd).enumerate() {
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
    // A block of rows of one GQA group as two GEMMs, the group's query heads stacked as rows
    // (head-major), so the K/V head is packed once for all of them.
    let group_gemm = |buf: &mut Scratch, it: &Prep, hg: usize, b: usize| {
        let (ks, k_head, k_row) = heads4(&it.k);
        let (vs, v_head, v_row) = heads4(&it.v);
        let (r0, live, kv_end) = it.block(b);
        let rb = live.len();
        let m = group * rb;
        buf.stack_queries(&it.q, hg * group..(hg + 1) * group, r0..r0 + rb);
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
        scatter(&buf.o, it, hg, r0, rb);
    };
    // A few prefill rows of one GQA group (a follow-up turn's, over a long cache) through the
    // hand-written kernel: chunk `ch` of the keys, as softmax parts where there are several.
    #[cfg(target_arch = "x86_64")]
    let few_rows = |buf: &mut Scratch, it: &Prep, hg: usize, b: usize, ch: usize| -> bool {
        if !it.few {
            return false;
        }
        let (r0, live, kv_end) = it.block(b);
        let rb = live.len();
        let m = group * rb;
        let (ks, k_head, k_row) = heads4(&it.k);
        let (vs, v_head, v_row) = heads4(&it.v);
        let (lo, hi) = (ch * it.chunk_keys, ((ch + 1) * it.chunk_keys).min(kv_end));
        buf.stack_queries(&it.q, hg * group..(hg + 1) * group, r0..r0 + rb);
        buf.live.clear();
        for _ in 0..group {
            buf.live
                .extend(live.iter().map(|&l| l.clamp(lo, hi.max(lo)) - lo));
        }
        buf.o.resize(m * hd, 0.0);
        buf.stats.resize(m, (0.0, 0.0));
        // SAFETY: `few_kernel` checked the CPU and `hd`; keys and values lo..hi of head hg
        // lie inside their tensors (the caller's shapes; `few` checked the strides).
        unsafe {
            x86::group_block(
                &buf.q,
                hd,
                &buf.live,
                ks.as_ptr().add(hg * k_head + lo * k_row as usize),
                k_row as usize,
                vs.as_ptr().add(hg * v_head + lo * v_row as usize),
                v_row as usize,
                scale,
                &mut buf.block,
                &mut buf.o,
                &mut buf.stats,
            )
        };
        if it.chunks == 1 {
            for (o, &(_, sum)) in buf.o.chunks_exact_mut(hd).zip(&buf.stats) {
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
            scatter(&buf.o, it, hg, r0, rb);
            return true;
        }
        let slot = split::slot_len(hd);
        for (r, (o, &(top, sum))) in buf.o.chunks_exact(hd).zip(&buf.stats).enumerate() {
            let (g, i) = (r / rb, r % rb);
            let at = (it.part0 + r0 + i) * (width / hd) * chunks_max * slot
                + ((hg * group + g) * chunks_max + ch) * slot;
            // SAFETY: this task alone writes its rows' slots of its heads and chunk.
            unsafe {
                let p = parts_ptr.get().add(at);
                *p = top;
                *p.add(1) = sum;
                std::ptr::copy_nonoverlapping(o.as_ptr(), p.add(2), hd);
            }
        }
        true
    };
    #[cfg(not(target_arch = "x86_64"))]
    let few_rows = |_: &mut Scratch, _: &Prep, _: usize, _: usize, _: usize| false;
    // A decode task's GQA group through the hand-written kernel: each K/V row read once.
    #[cfg(target_arch = "x86_64")]
    let group_rows = |scores: &mut Vec<f32>, it: &Prep, hg: usize, b: usize, ch: usize| -> bool {
        if !group_kernel || !it.decode {
            return false;
        }
        let ctx = (group, hd, width, scale, out_ptr, parts_ptr, chunks_max);
        if it.half {
            group_of_rows::<half::f16>(scores, it, hg, b, ch, ctx);
        } else {
            group_of_rows::<f32>(scores, it, hg, b, ch, ctx);
        }
        true
    };
    // One task's rows of one GQA group, K/V of either element type: whole, or chunk `ch` of
    // the keys as softmax parts.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::type_complexity)]
    fn group_of_rows<E: x86::KvElem + KvView>(
        scores: &mut Vec<f32>,
        it: &Prep,
        hg: usize,
        b: usize,
        ch: usize,
        (group, hd, width, scale, out_ptr, parts_ptr, chunks_max): (
            usize,
            usize,
            usize,
            f32,
            SendPtr,
            SendPtr,
            usize,
        ),
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
            if it.chunks > 1 {
                let slot = split::slot_len(hd);
                // This row's slots: head h, chunk c at (h · chunks_max + c) · slot.
                let base = (it.part0 + r0 + i) * (width / hd) * chunks_max * slot;
                let (lo, hi) = (ch * it.chunk_keys, ((ch + 1) * it.chunk_keys).min(live));
                let mut stats = vec![(0f32, 0f32); group];
                let mut outs: Vec<&mut [f32]> = (hg * group..(hg + 1) * group)
                    .map(|h| {
                        let at = base + (h * chunks_max + ch) * slot + 2;
                        // SAFETY: this task alone writes its rows' slots of its heads and chunk.
                        unsafe { std::slice::from_raw_parts_mut(parts_ptr.get().add(at), hd) }
                    })
                    .collect();
                if lo < hi {
                    // SAFETY: `available(hd)` checked; keys and values lo..hi < live are inside
                    // k0 / v0 (asserted above).
                    unsafe {
                        x86::group_part(
                            &q,
                            k0.as_ptr().add(lo * k_row as usize),
                            k_row as usize,
                            v0.as_ptr().add(lo * v_row as usize),
                            v_row as usize,
                            hi - lo,
                            scale,
                            scores,
                            &mut outs,
                            &mut stats,
                        )
                    };
                }
                for (g, &(top, sum)) in stats.iter().enumerate() {
                    let at = base + ((hg * group + g) * chunks_max + ch) * slot;
                    // SAFETY: as above; an empty chunk leaves a sum of 0, skipped by the merge.
                    unsafe {
                        *parts_ptr.get().add(at) = top;
                        *parts_ptr.get().add(at + 1) = if lo < hi { sum } else { 0.0 };
                    }
                }
                continue;
            }
            let at = (it.row0 + r0 + i) * width + hg * group * hd;
            // SAFETY: this task alone writes its rows' columns of its group's heads.
            let row = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), group * hd) };
            let mut outs: Vec<&mut [f32]> = row.chunks_exact_mut(hd).collect();
            // SAFETY: `available(hd)` checked; keys and values j < live are inside k0 / v0
            // (asserted above).
            unsafe {
                x86::group_row(
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
    let group_rows = |_: &mut Vec<f32>, _: &Prep, _: usize, _: usize, _: usize| false;
    let task = |buf: &mut Scratch, job: usize| {
        let it = &preps[preps.partition_point(|p| p.job0 <= job) - 1];
        let j = job - it.job0;
        let per_head = it.blocks * it.chunks;
        let (hg, b, ch) = (j / per_head, j % per_head / it.chunks, j % it.chunks);
        if group_rows(&mut buf.scores, it, hg, b, ch) {
            return;
        }
        let (k_row, v_row) = (it.k.layout().strides()[2], it.v.layout().strides()[2]);
        if it.decode && k_row > 0 && v_row > 0 {
            for h in hg * group..(hg + 1) * group {
                one_head(&mut buf.scores, it, h, b);
            }
        } else if !few_rows(buf, it, hg, b, ch) {
            group_gemm(buf, it, hg, b);
        }
    };
    let run = |j: usize| SCRATCH.with(|b| task(&mut b.borrow_mut(), j));
    if work < ATTENTION_PARALLEL_MIN {
        (0..jobs).for_each(run);
    } else {
        pool::for_each(jobs, &run);
    }
    let slot_row = heads * chunks_max * slot;
    for it in preps.iter().filter(|p| p.chunks > 1) {
        for r in 0..it.n {
            let row = &parts[(it.part0 + r) * slot_row..][..slot_row];
            for h in 0..heads {
                let head = &row[h * chunks_max * slot..][..it.chunks * slot];
                split::merge(head, hd, &mut out[(it.row0 + r) * width + h * hd..][..hd]);
            }
        }
    }
    wrap(out, [rows, width])
}

thread_local! {
    /// Each thread's attention buffers (scores are rows × keys: megabytes at long prompts).
    pub(super) static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// One attention task's buffers, kept per thread across tasks and calls.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(super) scores: Vec<f32>,
    /// A GQA group's query rows, stacked.
    q: Vec<f32>,
    /// Their outputs, before they go to their heads' columns.
    o: Vec<f32>,
    /// Keys seen by each stacked row.
    pub(super) live: Vec<usize>,
    /// The few-rows kernel's softmax parts, a (largest score, sum) pair a stacked row.
    stats: Vec<(f32, f32)>,
    /// The few-rows kernel's buffers.
    #[cfg(target_arch = "x86_64")]
    block: x86::BlockScratch,
}

impl Scratch {
    /// Stacks the query rows `rows` of heads `heads` of `q` (`[1, heads, n, hd]`), head-major,
    /// so a GQA group's heads meet their shared K/V head in one product.
    pub(super) fn stack_queries(
        &mut self,
        q: &FlexTensor,
        heads: Range<usize>,
        rows: Range<usize>,
    ) {
        let hd = q.layout().shape()[3];
        let (qs, q_head, q_row) = heads4(q);
        self.q.clear();
        for h in heads {
            for i in rows.clone() {
                self.q
                    .extend_from_slice(&qs[h * q_head + i * q_row as usize..][..hd]);
            }
        }
    }
}

#[cfg(test)]
mod tests;
