//! Attention against naive f64 references: prefill and decode rows, GQA groups, f16 caches,
//! long caches split into chunks of keys, query blocks and the softmax.

use super::*;
use burn::tensor::{Device, FloatDType, TensorData};

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

/// One sequence's attention, on the host.
fn attend(item: AttnItem) -> Vec<f32> {
    attention_many(vec![item])
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
}

/// Uniform values in `[-half, half)` from a fixed LCG.
fn values(n: usize, seed: &mut u32, half: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (*seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 * half - half
        })
        .collect()
}

/// Asserts `got` (`[n, heads·hd]`) is naive attention of `q` (`[heads, n, hd]`) over `k`, `v`
/// (`[kv_heads, t, hd]`), row `i` seeing its first `live(i)` keys.
#[allow(clippy::too_many_arguments)]
fn assert_rows_match_naive(
    what: &str,
    got: &[f32],
    (q, k, v): (&[f32], &[f32], &[f32]),
    (heads, kv_heads, hd): (usize, usize, usize),
    (n, t): (usize, usize),
    live: impl Fn(usize) -> usize,
) {
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
                    "{what} n {n} t {t} hd {hd} row {i} head {h} col {d}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn attention_rows_match_naive() {
    // GQA groups of 3, of 5 (the AVX2 kernel's 4 heads and 1) and of 8.
    for (heads, kv_heads) in [(9, 3), (10, 2), (8, 1)] {
        for half in [false, true] {
            attention_matches_naive(half, heads, kv_heads);
        }
    }
}

/// Decode rows (the group kernel) and prefill rows (an f16 cache widened first) against a
/// naive attention over the same (rounded) K/V.
fn attention_matches_naive(half: bool, heads: usize, kv_heads: usize) {
    let device = Device::flex();
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
        // Cache lengths around the 16-key blocks, and one long enough to split into
        // chunks of keys on 2 threads; sequences batched into one call.
        let lens = [1usize, 15, 16, 17, 40, 1100];
        let mut seed = 7u32;
        let mut rnd = |n: usize| values(n, &mut seed, 2.0);
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
            let got = attend(item);
            assert_rows_match_naive(
                &format!("prefill half {half}"),
                &got,
                (&q, &k, &v),
                (heads, kv_heads, hd),
                (n, t),
                live,
            );
        }
    }
}

#[test]
fn query_blocks_balance_the_threads() {
    let follow_up = |n: usize| -> Vec<usize> { (0..n).map(|i| 3000 + i + 1).collect() };
    // 3 K/V heads on 2 threads: 2 blocks a head make 6 tasks, 3 per thread.
    assert_eq!(query_block(&follow_up(19), 3, 2), 10);
    assert_eq!(query_block(&follow_up(37), 3, 2), 19);
    // One thread: one block, the K/V packed once.
    assert_eq!(query_block(&follow_up(19), 3, 1), 19);
    // Never more than QUERY_BLOCK rows, never blocks of decode size.
    assert!(query_block(&follow_up(500), 3, 2) <= QUERY_BLOCK);
    assert!(query_block(&follow_up(12), 3, 16) > DOT_ROWS_MAX);
    // A fresh prompt's causal rows keep several tasks a thread.
    let fresh: Vec<usize> = (1..=512).collect();
    assert_eq!(query_block(&fresh, 3, 2), QUERY_BLOCK);
    let fresh: Vec<usize> = (1..=40).collect();
    assert_eq!(query_block(&fresh, 3, 2), 14);
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

#[test]
fn follow_up_rows_over_a_long_cache_match_naive() {
    // A follow-up turn's rows over a long cache: stacked GQA rows of one vector (16 or fewer),
    // of two (up to 32, the few-rows kernel), and past it (the GEMM); key counts around the
    // kernel's key blocks.
    let device = Device::flex();
    let mut seed = 11u32;
    let mut rnd = |n: usize| values(n, &mut seed, 2.0);
    // Rows at scattered positions whose keys end before the second chunk's (an exact pass
    // over a long cache): their parts there are empty.
    let scattered = vec![3, 10, 1500, 2000, 2100];
    for (heads, kv_heads, n, t, hd, seen) in [
        (9, 3, 19, 3019, 64, Vec::new()),
        (9, 3, 5, 1300, 64, Vec::new()),
        (9, 3, 11, 137, 128, Vec::new()),
        (4, 1, 8, 500, 64, Vec::new()),
        (10, 2, 19, 700, 64, Vec::new()),
        (9, 3, 5, 2100, 64, scattered),
    ] {
        let q = rnd(heads * n * hd);
        let (k, v) = (rnd(kv_heads * t * hd), rnd(kv_heads * t * hd));
        let item = AttnItem {
            q: Tensor::from_data(TensorData::new(q.clone(), [1, heads, n, hd]), &device),
            k: Tensor::from_data(TensorData::new(k.clone(), [1, kv_heads, t, hd]), &device),
            v: Tensor::from_data(TensorData::new(v.clone(), [1, kv_heads, t, hd]), &device),
            seen: seen.clone(),
        };
        let got = attend(item);
        assert_rows_match_naive(
            &format!("heads {heads}/{kv_heads}"),
            &got,
            (&q, &k, &v),
            (heads, kv_heads, hd),
            (n, t),
            |i| seen.get(i).copied().unwrap_or(t - n + i + 1),
        );
    }
}

#[test]
fn a_follow_up_row_is_its_cold_row_bit_for_bit() {
    // The reused = cold guarantee: the last rows of a prompt attended as a follow-up over the
    // cached rest (their key chunks as tasks) give the bits the whole prompt's cold attention
    // gives them (chunks looped in a task), where the block kernel runs.
    let device = Device::flex();
    let (heads, kv_heads, hd, t) = (9, 3, 64, 1300);
    let mut seed = 5u32;
    let mut rnd = |n: usize| values(n, &mut seed, 4.0);
    let (q, k, v) = (
        rnd(heads * t * hd),
        rnd(kv_heads * t * hd),
        rnd(kv_heads * t * hd),
    );
    let kv =
        |x: &[f32]| Tensor::from_data(TensorData::new(x.to_vec(), [1, kv_heads, t, hd]), &device);
    let run = |n: usize| -> Vec<f32> {
        // Queries of the last n rows, head-major.
        let rows: Vec<f32> = (0..heads)
            .flat_map(|h| q[(h * t + t - n) * hd..(h + 1) * t * hd].to_vec())
            .collect();
        let item = AttnItem {
            q: Tensor::from_data(TensorData::new(rows, [1, heads, n, hd]), &device),
            k: kv(&k),
            v: kv(&v),
            seen: Vec::new(),
        };
        attend(item)
    };
    let cold = run(t);
    #[cfg(target_arch = "x86_64")]
    let exact = x86::block_available(hd);
    #[cfg(not(target_arch = "x86_64"))]
    let exact = false;
    for n in [19, 8, 40] {
        let follow = run(n);
        let width = heads * hd;
        let tail = &cold[(t - n) * width..];
        for (i, (a, b)) in follow.iter().zip(tail).enumerate() {
            if exact {
                assert_eq!(a.to_bits(), b.to_bits(), "n {n} element {i}: {a} vs {b}");
            } else {
                assert!((a - b).abs() < 1e-5, "n {n} element {i}: {a} vs {b}");
            }
        }
    }
}
