//! The attention a fill's tail gives each cached position, summed over heads and rows: how
//! the tail ranks the rows its spans run exactly.

use burn::tensor::{DType, Tensor};
use ridgefill_quant::pool;

use super::super::flex::{flex, heads4};
use super::super::par::SendPtr;
use super::super::simd::softmax_rows;
use super::{SCRATCH, Scratch};

/// The level whose f32 dot-product tiles [`attention_received`] runs: they are AVX2 code, which
/// an AVX-512 level runs too (there the tensor ops took 8 ms for a chat follow-up's 20 rows over
/// 2800 keys, against ~1 ms); a level lowered below AVX2 runs none.
fn tile_level() -> Option<ridgefill_quant::SimdLevel> {
    use ridgefill_quant::{SimdLevel, has_dot_tiles};
    let detected = SimdLevel::detect();
    [detected, SimdLevel::Avx2]
        .into_iter()
        .find(|&l| l <= detected && has_dot_tiles(l))
}

/// The attention each of `k`'s positions receives from the query rows `q`, summed over heads
/// and rows, row `i` seeing the first `seen[i]` keys: how a fill's tail ranks the rows its spans
/// run exactly. One task per K/V head scores its stacked query heads in `ridgefill-quant`'s f32
/// dot-product tiles (the keys as they lie in the cache, no packing); `None` where those tiles
/// do not run, and the caller uses tensor ops (which build the `[heads, t, keys]` logits, mask
/// and probabilities as separate tensors: 5–13 ms for a chat follow-up's 16–19 rows over 2800
/// keys on 2 AVX2 threads, against 1.3–2.8 ms here).
///
/// # Shapes
/// - q: `[1, heads, t, hd]`, k: `[1, kv_heads, keys, hd]`, seen: `[t]` → `[keys]`
pub fn attention_received(
    q: Tensor<4>,
    k: Tensor<4>,
    seen: &[usize],
    scale: f32,
) -> Option<Vec<f32>> {
    let level = tile_level()?;
    let [_, heads, t, hd] = q.dims();
    let [_, kv_heads, keys, _] = k.dims();
    let f32s = q.dtype() == DType::F32 && k.dtype() == DType::F32;
    let shaped = seen.len() == t && heads.is_multiple_of(kv_heads) && t > 0 && hd > 0;
    if !f32s || !shaped {
        return None;
    }
    let kv_end = seen.iter().copied().max()?;
    if seen.contains(&0) || kv_end > keys {
        return None;
    }
    let (q, k) = (flex(q), flex(k));
    let (ks, k_head, k_row) = heads4(&k);
    // The tiles read whole rows back to back.
    if k_row != hd as isize {
        return None;
    }
    let group = heads / kv_heads;
    let mut sums = vec![0f32; kv_heads * keys];
    let sums_ptr = SendPtr(sums.as_mut_ptr());
    let task = |buf: &mut Scratch, hg: usize| {
        buf.stack_queries(&q, hg * group..(hg + 1) * group, 0..t);
        buf.live.clear();
        (0..group).for_each(|_| buf.live.extend_from_slice(seen));
        let m = group * t;
        buf.scores.resize(m * kv_end, 0.0);
        let keys_of_head = &ks[hg * k_head..][..kv_end * hd];
        // SAFETY: `scores` holds m rows of kv_end, written by this task alone.
        let ran = unsafe {
            ridgefill_quant::dot_tiles(
                level,
                &buf.q,
                keys_of_head,
                hd,
                buf.scores.as_mut_ptr(),
                kv_end,
            )
        };
        assert!(ran, "dot tiles were checked available");
        buf.scores.iter_mut().for_each(|s| *s *= scale);
        softmax_rows(&mut buf.scores, kv_end, &buf.live);
        // SAFETY: each task writes only its own K/V head's `keys` sums.
        let out = unsafe { std::slice::from_raw_parts_mut(sums_ptr.get().add(hg * keys), keys) };
        for row in buf.scores.chunks_exact(kv_end) {
            out.iter_mut().zip(row).for_each(|(o, p)| *o += p);
        }
    };
    let run = |hg: usize| SCRATCH.with(|b| task(&mut b.borrow_mut(), hg));
    pool::for_each(kv_heads, &run);
    let (first, rest) = sums.split_at_mut(keys);
    for other in rest.chunks_exact(keys) {
        first.iter_mut().zip(other).for_each(|(a, b)| *a += b);
    }
    sums.truncate(keys);
    Some(sums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// The attention each key receives, against the probabilities in f64, summed over heads
    /// and rows (GQA: two query heads per K/V head, causal rows).
    #[test]
    fn attention_received_sums_every_heads_probabilities() {
        let device = Device::flex();
        let (heads, kv_heads, hd, t, keys) = (4, 2, 32, 5, 37);
        let data = |n: usize, salt: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 1000) as f32 / 500.0 - 1.0)
                .collect()
        };
        let (q, k) = (data(heads * t * hd, 1), data(kv_heads * keys * hd, 2));
        let seen: Vec<usize> = (0..t).map(|i| keys - t + i + 1).collect();
        let scale = 0.2;
        let got = attention_received(
            Tensor::from_data(TensorData::new(q.clone(), [1, heads, t, hd]), &device),
            Tensor::from_data(TensorData::new(k.clone(), [1, kv_heads, keys, hd]), &device),
            &seen,
            scale,
        );
        let Some(got) = got else {
            assert!(
                tile_level().is_none(),
                "the tiles run here, yet nothing came back"
            );
            return;
        };
        let mut want = vec![0f64; keys];
        for h in 0..heads {
            let kh = h / (heads / kv_heads);
            for (i, &live) in seen.iter().enumerate() {
                let s: Vec<f64> = (0..live)
                    .map(|j| {
                        (0..hd)
                            .map(|c| {
                                f64::from(q[(h * t + i) * hd + c])
                                    * f64::from(k[(kh * keys + j) * hd + c])
                            })
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let top = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - top).exp()).sum();
                s.iter()
                    .enumerate()
                    .for_each(|(j, x)| want[j] += (x - top).exp() / z);
            }
        }
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((f64::from(*a) - b).abs() < 1e-4, "key {j}: {a} vs {b}");
        }
    }
}
