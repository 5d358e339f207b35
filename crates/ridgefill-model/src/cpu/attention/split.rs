//! Decode rows over a long cache split by keys: one sequence's decode step has a task per K/V
//! head, too few to keep every thread busy (SmolLM2's 3 on 2 threads leave one idle a third of
//! the time), so each head's keys are cut into chunks whose softmax parts are merged after.

/// Keys a chunk holds at least: below this its setup and merge outweigh the balance.
const CHUNK_KEYS_MIN: usize = 512;
/// A chunk's cost beyond its keys, in keys: the query setup and the merge.
const CHUNK_OVERHEAD_KEYS: usize = 64;

/// Chunks per K/V head for decode rows over `keys` keys: the count whose `kv_heads · chunks`
/// tasks finish soonest on `threads` threads, each chunk at least [`CHUNK_KEYS_MIN`] keys.
pub(super) fn key_chunks(keys: usize, kv_heads: usize, threads: usize) -> usize {
    let most = (keys / CHUNK_KEYS_MIN).max(1);
    let finish =
        |c: usize| (kv_heads * c).div_ceil(threads) * (keys.div_ceil(c) + CHUNK_OVERHEAD_KEYS);
    (1..=most).min_by_key(|&c| finish(c)).unwrap_or(1)
}

/// One softmax part's slot: the largest score, the sum of e^(s − max), then `hd` weighted
/// values (`x86::group_part`'s outputs).
pub(super) const fn slot_len(hd: usize) -> usize {
    hd + 2
}

/// Merges a row's parts (`slot_len(hd)` floats each, a part with no keys holding a sum of 0)
/// into `out`: `Σ_c e^(m_c − M) o_c / Σ_c e^(m_c − M) l_c` with `M` the largest `m_c`.
pub(super) fn merge(parts: &[f32], hd: usize, out: &mut [f32]) {
    let slots = parts.chunks_exact(slot_len(hd)).filter(|p| p[1] > 0.0);
    let top = slots
        .clone()
        .map(|p| p[0])
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut sum = 0.0;
    for p in slots {
        let w = (p[0] - top).exp();
        sum += w * p[1];
        out.iter_mut().zip(&p[2..]).for_each(|(o, v)| *o += w * v);
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_balance_the_threads() {
        // 3 K/V heads on 2 threads: two chunks a head make 6 tasks.
        assert_eq!(key_chunks(3000, 3, 2), 2);
        // Short caches and a balanced split stay whole.
        assert_eq!(key_chunks(800, 3, 2), 1);
        assert_eq!(key_chunks(3000, 2, 2), 1);
        assert_eq!(key_chunks(3000, 3, 1), 1);
        // Many threads: chunks no shorter than the minimum.
        let c = key_chunks(3000, 3, 16);
        assert!(c > 1 && 3000 / c >= CHUNK_KEYS_MIN, "{c}");
    }

    #[test]
    fn merged_parts_are_the_whole_softmax() {
        let (hd, scores) = (2, [0.5f32, 3.0, -1.0, 2.0, 0.0]);
        let values = [
            [1.0f32, 0.0],
            [0.0, 1.0],
            [2.0, 2.0],
            [-1.0, 3.0],
            [0.5, 0.5],
        ];
        let part = |range: std::ops::Range<usize>| -> Vec<f32> {
            let top = scores[range.clone()]
                .iter()
                .cloned()
                .fold(f32::MIN, f32::max);
            let mut slot = vec![top, 0.0, 0.0, 0.0];
            for j in range {
                let w = (scores[j] - top).exp();
                slot[1] += w;
                slot[2] += w * values[j][0];
                slot[3] += w * values[j][1];
            }
            slot
        };
        let empty = vec![0.0; slot_len(hd)];
        let parts = [part(0..2), empty, part(2..5)].concat();
        let mut got = [0f32; 2];
        merge(&parts, hd, &mut got);
        let z: f32 = scores.iter().map(|s| s.exp()).sum();
        for d in 0..hd {
            let want: f32 = scores
                .iter()
                .zip(&values)
                .map(|(s, v)| s.exp() * v[d])
                .sum::<f32>()
                / z;
            assert!((got[d] - want).abs() < 1e-6, "{d}: {} vs {want}", got[d]);
        }
    }
}
