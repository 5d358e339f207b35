//! Causal grouped-query attention on flex tensors: prompt rows through the x86 block kernel
//! (AVX-512) or as GEMMs over each GQA group's stacked query heads, decode rows as dot products
//! (or the x86 group kernel), every sequence's tasks in one parallel dispatch; masked entries are
//! never scored.

mod received;
mod scratch;
mod split;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use received::attention_received;

use scratch::{SCRATCH, Scratch};

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

/// Stacked query rows (GQA group × prompt rows) up to which the block kernel's key chunks are
/// tasks of their own, merged after the dispatch (a follow-up turn's few rows over a long
/// cache, whose 3 K/V heads alone leave a thread idle); larger prompts loop over them in a task.
const SPREAD_ROWS_MAX: usize = 128;

/// Keys per chunk of the block kernel, at fixed boundaries: a prompt row's attention is then the
/// same sums in the same order whether its prompt ran cold or as a follow-up over a reused
/// prefix, with its chunks as tasks or as a loop — bit for bit, which the reused = cold
/// guarantee needs where the weights quantise activations to 8 bits (a last-bit change there
/// moved SmolLM2's logits by 0.40).
const PROMPT_KEY_CHUNK: usize = 512;

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
/// stacked, so each K/V head is packed once per block rather than once per query head (where
/// AVX-512 runs, blocks of the block kernel instead, keys in [`PROMPT_KEY_CHUNK`] chunks whose
/// softmax parts are merged); decode rows through the group kernel. The tasks of all sequences
/// share one parallel dispatch, where one decode row's attention alone is too small to split.
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
        /// Prompt rows through the block kernel; with `spread`, a task a chunk of keys.
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        blocked: bool,
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        spread: bool,
        /// Tasks per block of rows and K/V head: `chunks` where parts are merged after the
        /// dispatch, else 1.
        per_block: usize,
        /// Query rows per block, and blocks.
        qblock: usize,
        blocks: usize,
        /// Decode and block-kernel rows: chunks of keys per K/V head, keys per chunk, and the first
        /// of this sequence's rows' softmax parts (where chunks are tasks).
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
    let (block_kernel, block_rows_max) = (x86::block_available(hd), x86::BLOCK_ROWS_MAX);
    #[cfg(not(target_arch = "x86_64"))]
    let (block_kernel, block_rows_max) = (false, 1);
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
            let blocked = block_kernel && !decode && forwards && group <= block_rows_max;
            let (qblock, chunks) = if blocked {
                // Blocks of stacked rows that fit the kernel, as even as their count allows.
                let blocks = n.div_ceil(block_rows_max / group);
                (n.div_ceil(blocks), keys.div_ceil(PROMPT_KEY_CHUNK))
            } else if group_kernel && decode {
                (
                    query_block(&seen, kv_heads, threads),
                    split::key_chunks(keys, kv_heads, threads),
                )
            } else {
                (query_block(&seen, kv_heads, threads), 1)
            };
            let blocks = n.div_ceil(qblock);
            let spread = blocked && group * n <= SPREAD_ROWS_MAX && chunks > 1;
            let per_block = if blocked && !spread { 1 } else { chunks };
            let p = Prep {
                q: flex(it.q),
                k,
                v,
                half: direct,
                n,
                seen,
                decode,
                blocked,
                spread,
                per_block,
                qblock,
                blocks,
                row0: rows,
                job0: jobs,
                chunks,
                chunk_keys: if blocked {
                    PROMPT_KEY_CHUNK
                } else {
                    keys.div_ceil(chunks)
                },
                part0: part_rows,
            };
            rows += n;
            jobs += kv_heads * blocks * per_block;
            if per_block > 1 {
                part_rows += n;
            }
            work += heads * n * t * hd;
            p
        })
        .collect();
    let mut out = vec![0f32; rows * width];
    let out_ptr = SendPtr(out.as_mut_ptr());
    // Split decode rows' softmax parts: per row, head and chunk, one `split::slot_len` slot.
    let chunks_max = preps.iter().map(|p| p.per_block).max().unwrap_or(1);
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
    // A block of prompt rows of one GQA group through the block kernel, keys in fixed chunks:
    // chunk `ch` as softmax parts merged after the dispatch (`spread`), or every chunk the block
    // sees, merged here the same way.
    #[cfg(target_arch = "x86_64")]
    let block_rows = |buf: &mut Scratch, it: &Prep, hg: usize, b: usize, ch: usize| -> bool {
        if !it.blocked {
            return false;
        }
        let (r0, live, kv_end) = it.block(b);
        let (rb, ck) = (live.len(), it.chunk_keys);
        let m = group * rb;
        let chunks = if it.spread {
            ch..(ch + 1).min(kv_end.div_ceil(ck))
        } else {
            0..kv_end.div_ceil(ck)
        };
        if chunks.is_empty() {
            // Keys past the block's last row: its parts stay empty (a sum of 0, skipped).
            return true;
        }
        let (ks, k_head, k_row) = heads4(&it.k);
        let (vs, v_head, v_row) = heads4(&it.v);
        let slot = split::slot_len(hd);
        buf.stack_queries(&it.q, hg * group..(hg + 1) * group, r0..r0 + rb);
        buf.o.resize(m * hd, 0.0);
        buf.stats.resize(m, (0.0, 0.0));
        let count = chunks.len();
        buf.parts.clear();
        buf.parts.resize(m * count * slot, 0.0);
        for (c, chunk) in chunks.clone().enumerate() {
            let (lo, hi) = (chunk * ck, ((chunk + 1) * ck).min(kv_end));
            buf.live.clear();
            for _ in 0..group {
                buf.live.extend(live.iter().map(|&l| l.clamp(lo, hi) - lo));
            }
            // SAFETY: `block_kernel` checked the CPU and `hd`; keys and values lo..hi < kv_end of
            // head hg lie inside their tensors (the caller's shapes; `blocked` checked the strides).
            unsafe {
                x86::group_block(
                    x86::BlockIn {
                        q: &buf.q,
                        hd,
                        live: &buf.live,
                        ks: ks.as_ptr().add(hg * k_head + lo * k_row as usize),
                        k_row: k_row as usize,
                        vs: vs.as_ptr().add(hg * v_head + lo * v_row as usize),
                        v_row: v_row as usize,
                        scale,
                    },
                    &mut buf.block,
                    &mut buf.o,
                    &mut buf.stats,
                )
            };
            for (r, (o, &(top, sum))) in buf.o.chunks_exact(hd).zip(&buf.stats).enumerate() {
                let part = &mut buf.parts[(r * count + c) * slot..][..slot];
                part[0] = top;
                part[1] = sum;
                part[2..].copy_from_slice(o);
            }
        }
        if it.spread {
            for (r, part) in buf.parts.chunks_exact(slot).enumerate() {
                let (g, i) = (r / rb, r % rb);
                let at = (it.part0 + r0 + i) * (width / hd) * chunks_max * slot
                    + ((hg * group + g) * chunks_max + ch) * slot;
                // SAFETY: this task alone writes its rows' slots of its heads and chunk.
                unsafe {
                    std::ptr::copy_nonoverlapping(part.as_ptr(), parts_ptr.get().add(at), slot)
                };
            }
            return true;
        }
        for (r, o) in buf.o.chunks_exact_mut(hd).enumerate() {
            split::merge(&buf.parts[r * count * slot..][..count * slot], hd, o);
        }
        scatter(&buf.o, it, hg, r0, rb);
        true
    };
    #[cfg(not(target_arch = "x86_64"))]
    let block_rows = |_: &mut Scratch, _: &Prep, _: usize, _: usize, _: usize| false;
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
        let per_head = it.blocks * it.per_block;
        let (hg, b, ch) = (j / per_head, j % per_head / it.per_block, j % it.per_block);
        if group_rows(&mut buf.scores, it, hg, b, ch) {
            return;
        }
        let (k_row, v_row) = (it.k.layout().strides()[2], it.v.layout().strides()[2]);
        if it.decode && k_row > 0 && v_row > 0 {
            for h in hg * group..(hg + 1) * group {
                one_head(&mut buf.scores, it, h, b);
            }
        } else if !block_rows(buf, it, hg, b, ch) {
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
    for it in preps.iter().filter(|p| p.per_block > 1) {
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

#[cfg(test)]
mod tests;
