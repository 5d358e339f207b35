//! Token sampling on the host: greedy, temperature, top-k, top-p, min-p, seeded.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        // llama.cpp's defaults.
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: StdRng,
}

/// Index of the largest value (first one on ties, as torch's argmax); NaNs are passed over, and
/// all-NaN gives 0.
///
/// Two passes that vectorise (the max over independent lanes, then the first index holding it)
/// rather than one loop whose every step waits on the last: a greedy batch of eight spent 2% of
/// its decode step here.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    let max = acc
        .iter()
        .chain(chunks.remainder())
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    logits.iter().position(|&x| x == max).unwrap_or(0) as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Self { cfg, rng }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token from one position's logits.
    ///
    /// Top-k is a selection and min-p a filter. Where top-p cuts a nucleus, the candidates are
    /// walked from the most likely down, as a full sort would order them, but sorted only as
    /// far as the walk goes, a growing block at a time ([`Ranked`]); where it cuts nothing the
    /// draw needs no order at all. A full sort of a 49k vocabulary cost ~2 ms a token, a third
    /// of a single stream's decode and far more than a batched step's share.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let finite = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i as u32, x * inv_t));
        // top-k: the k best under the same order a sort would give, in no particular order.
        let mut cand = match self.cfg.top_k {
            0 => finite.collect(),
            k => top_k(finite, k),
        };
        if cand.is_empty() {
            return argmax(logits);
        }
        let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        // Each candidate's weight exp(x − max), once; the total in f64.
        let mut weights: Vec<f32> = cand.iter().map(|c| c.1).collect();
        let total = exp_weights(&mut weights, max);
        // min-p: drop tokens below min_p × the top probability (`exp(0) / total`).
        if self.cfg.min_p > 0.0 {
            let floor = f64::from(self.cfg.min_p) / total;
            (cand, weights) = cand
                .iter()
                .zip(&weights)
                .filter(|&(_, &e)| f64::from(e) / total >= floor)
                .map(|(&c, &e)| (c, e))
                .unzip();
            if cand.is_empty() {
                // Only reachable through rounding: the top token always passes.
                return argmax(logits);
            }
        }
        if self.cfg.top_p >= 1.0 {
            // No nucleus to cut: the draw walks the candidates in the order they are held
            // (a deterministic one), which gives the rank order's distribution unranked.
            let mass: f64 = sum_f64(&weights);
            let mut r = f64::from(self.rng.random::<f32>()) * mass;
            for (&(id, _), &e) in cand.iter().zip(&weights) {
                let e = f64::from(e);
                if r < e {
                    return id;
                }
                r -= e;
            }
            return cand[cand.len() - 1].0;
        }
        // Each candidate ranked with the weight already computed for it.
        let mut ranked = Ranked::new(
            cand.iter()
                .zip(&weights)
                .map(|(&(id, x), &e)| (id, x, e))
                .collect(),
        );
        let prob = |e: f32| f64::from(e) / total;
        // top-p: the smallest prefix in rank order whose mass reaches top_p.
        let (keep, mass) = {
            let mut acc = 0.0;
            let mut n = 0;
            while n < ranked.len() {
                acc += prob(ranked.get(n).2);
                n += 1;
                if acc >= f64::from(self.cfg.top_p) {
                    break;
                }
            }
            (n, acc)
        };
        let mut r = f64::from(self.rng.random::<f32>()) * mass;
        for i in 0..keep {
            let (id, _, e) = ranked.get(i);
            let p = prob(e);
            if r < p {
                return id;
            }
            r -= p;
        }
        ranked.get(keep - 1).0
    }
}

/// One draw per sequence from `logits` (`samplers.len()` rows of `vocab`), the sequences spread
/// over the matmul pool: a batched decode step's sampling is otherwise serial (~0.5 ms a
/// sequence at temperature 1 over a 49k vocabulary).
pub fn sample_rows(samplers: &mut [&mut Sampler], logits: &[f32], vocab: usize) -> Vec<u32> {
    assert_eq!(
        logits.len(),
        samplers.len() * vocab,
        "one logits row per sampler"
    );
    let cells: Vec<std::sync::Mutex<&mut Sampler>> = samplers
        .iter_mut()
        .map(|s| std::sync::Mutex::new(&mut **s))
        .collect();
    let picked: Vec<std::sync::atomic::AtomicU32> = (0..cells.len())
        .map(|_| std::sync::atomic::AtomicU32::new(0))
        .collect();
    ridgefill_quant::pool::for_each(cells.len(), &|i| {
        // Each row's sampler is locked by its own task only.
        let mut s = cells[i].lock().unwrap_or_else(|e| e.into_inner());
        let token = s.sample(&logits[i * vocab..(i + 1) * vocab]);
        picked[i].store(token, std::sync::atomic::Ordering::Relaxed);
    });
    picked.into_iter().map(|p| p.into_inner()).collect()
}

/// The `k` best of `items` under [`rank`], in no particular order: a buffer of up to `2k` is cut
/// back to its best `k` when full, and an item enters only if it beats the worst kept one, so
/// a vocabulary costs one comparison per logit rather than a selection over all of them.
fn top_k(items: impl Iterator<Item = (u32, f32)>, k: usize) -> Vec<(u32, f32)> {
    let mut buf: Vec<(u32, f32)> = Vec::with_capacity(2 * k);
    // The worst of the kept k once the buffer has been cut (items arrive in id order, so an
    // equal value ranks below it and stays out).
    let mut floor: Option<(u32, f32)> = None;
    for it in items {
        if floor.is_some_and(|f| rank(&it, &f) != std::cmp::Ordering::Less) {
            continue;
        }
        buf.push(it);
        if buf.len() == 2 * k {
            buf.select_nth_unstable_by(k - 1, rank);
            buf.truncate(k);
            floor = Some(buf[k - 1]);
        }
    }
    if buf.len() > k {
        buf.select_nth_unstable_by(k - 1, rank);
        buf.truncate(k);
    }
    buf
}

/// Replaces each x by e^(x − max) and returns their sum in f64 (vectorised on the CPU build).
fn exp_weights(xs: &mut [f32], max: f32) -> f64 {
    #[cfg(feature = "flex")]
    crate::cpu::exp_shifted(xs, max);
    #[cfg(not(feature = "flex"))]
    xs.iter_mut().for_each(|x| *x = (*x - max).exp());
    sum_f64(xs)
}

/// Σ xs in f64, over independent lanes so the additions overlap.
fn sum_f64(xs: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] += f64::from(c[l]);
        }
    }
    acc.iter().sum::<f64>()
        + chunks
            .remainder()
            .iter()
            .map(|&x| f64::from(x))
            .sum::<f64>()
}

/// Most likely first; ties by token id (a total order, so selection and sorting agree).
fn rank(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Candidates `(id, scaled logit, weight)` in [`rank`] order, sorted lazily: a block at a time,
/// each selected from what is left and then sorted, blocks growing fourfold, so a walk that
/// stops early costs O(n).
struct Ranked {
    cand: Vec<(u32, f32, f32)>,
    /// `cand[..sorted]` is in final order.
    sorted: usize,
}

/// [`rank`] on a candidate with its weight.
fn rank_weighted(a: &(u32, f32, f32), b: &(u32, f32, f32)) -> std::cmp::Ordering {
    rank(&(a.0, a.1), &(b.0, b.1))
}

impl Ranked {
    /// The first block: enough for a typical nucleus.
    const FIRST_BLOCK: usize = 256;

    fn new(cand: Vec<(u32, f32, f32)>) -> Self {
        Self { cand, sorted: 0 }
    }

    fn len(&self) -> usize {
        self.cand.len()
    }

    /// The `i`-th candidate in rank order.
    fn get(&mut self, i: usize) -> (u32, f32, f32) {
        while self.sorted <= i {
            let block = Self::FIRST_BLOCK.max(3 * self.sorted);
            let end = (self.sorted + block).min(self.cand.len());
            let rest = &mut self.cand[self.sorted..];
            if end < self.sorted + rest.len() {
                rest.select_nth_unstable_by(end - self.sorted - 1, rank_weighted);
            }
            self.cand[self.sorted..end].sort_unstable_by(rank_weighted);
            self.sorted = end;
        }
        self.cand[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_largest_anywhere() {
        // Past the 16-lane chunks, in them, tied, after NaNs, all NaN.
        let mut v: Vec<f32> = (0..100).map(|i| (i % 7) as f32).collect();
        v[98] = 9.0;
        assert_eq!(argmax(&v), 98);
        v[40] = 9.0;
        assert_eq!(argmax(&v), 40);
        v[3] = f32::NAN;
        assert_eq!(argmax(&v), 40);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0, 2.0]), 2);
        assert_eq!(argmax(&[f32::NAN; 5]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_is_reproducible() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 should vary");
        let mut k1 = Sampler::new(SamplerConfig { top_k: 1, ..cfg });
        assert_eq!(k1.sample(&logits), argmax(&logits));
    }

    #[test]
    fn min_p_and_top_p_restrict_to_dominant_token() {
        let logits = [10.0, 0.0, 0.0, 0.0];
        for cfg in [
            SamplerConfig {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.5,
                seed: 1,
            },
            SamplerConfig {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                min_p: 0.0,
                seed: 1,
            },
        ] {
            let mut s = Sampler::new(cfg);
            for _ in 0..50 {
                assert_eq!(s.sample(&logits), 0);
            }
        }
    }

    /// The sampler's definition, as it ran before lazy ranking: sort everything, then filter.
    fn sample_by_full_sort(cfg: &SamplerConfig, rng: &mut StdRng, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / cfg.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i as u32, x * inv_t))
            .collect();
        cand.sort_unstable_by(rank);
        if cfg.top_k > 0 {
            cand.truncate(cfg.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|(_, x)| f64::from((x - max).exp()))
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if cfg.min_p > 0.0 {
            let floor = f64::from(cfg.min_p) / total;
            keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        }
        if cfg.top_p < 1.0 {
            let (mut acc, mut n) = (0.0, 0);
            for &p in &probs[..keep] {
                acc += p;
                n += 1;
                if acc >= f64::from(cfg.top_p) {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = f64::from(rng.random::<f32>()) * mass;
        for (i, &p) in probs[..keep].iter().enumerate() {
            if r < p {
                return cand[i].0;
            }
            r -= p;
        }
        cand[keep - 1].0
    }

    /// Lazy ranking draws the token a full sort draws from the same random number, on a
    /// vocabulary-sized spread of logits with ties and non-finite values, wherever a nucleus is
    /// cut (only a draw within float rounding of a boundary may differ: the sums run in other
    /// orders).
    #[test]
    fn lazy_ranking_draws_what_a_full_sort_draws() {
        const VOCAB: usize = 49_152;
        const DRAWS: usize = 300;
        let mut spread = StdRng::seed_from_u64(3);
        let mut logits: Vec<f32> = (0..VOCAB)
            .map(|_| (spread.random::<f32>() * 8.0).powi(2) / 6.0 - 4.0)
            .collect();
        logits[17] = f32::NAN;
        logits[99] = f32::NEG_INFINITY;
        logits[500] = logits[501];
        // With a nucleus to cut (top-p < 1) the walk runs in rank order, draw for draw.
        let configs = [
            (1.0, 0, 0.9, 0.0),
            (0.8, 40, 0.95, 0.05),
            (1.3, 1000, 0.5, 0.0),
            (0.5, 0, 0.99, 0.01),
        ];
        for (temperature, top_k, top_p, min_p) in configs {
            let cfg = SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 11,
            };
            let mut lazy = Sampler::new(cfg.clone());
            let mut rng = StdRng::seed_from_u64(cfg.seed);
            let mut same = 0;
            let mut distinct = std::collections::HashSet::new();
            for _ in 0..DRAWS {
                let a = lazy.sample(&logits);
                let b = sample_by_full_sort(&cfg, &mut rng, &logits);
                same += usize::from(a == b);
                distinct.insert(a);
            }
            assert!(same >= DRAWS - 2, "{cfg:?}: {same}/{DRAWS} draws agree");
            assert!(
                distinct.len() > 10,
                "{cfg:?}: only {} tokens drawn",
                distinct.len()
            );
        }
    }

    /// Sampling rows on the pool draws what each sampler draws alone, row by row.
    #[test]
    fn sample_rows_equals_each_row_alone() {
        const VOCAB: usize = 1000;
        const ROWS: usize = 5;
        let logits: Vec<f32> = (0..ROWS * VOCAB)
            .map(|i| ((i * 7919) % 1013) as f32 / 200.0)
            .collect();
        let cfg = |seed| SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
            seed,
        };
        let mut alone: Vec<Sampler> = (0..ROWS as u64).map(|i| Sampler::new(cfg(i))).collect();
        let mut pooled: Vec<Sampler> = (0..ROWS as u64).map(|i| Sampler::new(cfg(i))).collect();
        for _ in 0..10 {
            let want: Vec<u32> = alone
                .iter_mut()
                .enumerate()
                .map(|(i, s)| s.sample(&logits[i * VOCAB..(i + 1) * VOCAB]))
                .collect();
            let mut refs: Vec<&mut Sampler> = pooled.iter_mut().collect();
            assert_eq!(sample_rows(&mut refs, &logits, VOCAB), want);
        }
    }

    /// Without a nucleus to cut, draws follow the definition's distribution (softmax at the
    /// temperature, min-p applied): frequencies within five standard errors.
    #[test]
    fn untruncated_draws_follow_the_softmax() {
        const VOCAB: usize = 64;
        const DRAWS: usize = 40_000;
        let logits: Vec<f32> = (0..VOCAB).map(|i| ((i * 37) % 64) as f32 / 16.0).collect();
        for (temperature, min_p) in [(1.0f32, 0.0f32), (0.7, 0.05)] {
            let cfg = SamplerConfig {
                temperature,
                top_k: 0,
                top_p: 1.0,
                min_p,
                seed: 5,
            };
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let w: Vec<f64> = logits
                .iter()
                .map(|&x| f64::from((x - max) / temperature).exp())
                .collect();
            let kept: Vec<f64> = w
                .iter()
                .map(|&e| if e >= f64::from(min_p) { e } else { 0.0 })
                .collect();
            let total: f64 = kept.iter().sum();
            let mut counts = vec![0usize; VOCAB];
            let mut s = Sampler::new(cfg);
            for _ in 0..DRAWS {
                counts[s.sample(&logits) as usize] += 1;
            }
            for (t, (&c, &e)) in counts.iter().zip(&kept).enumerate() {
                let p = e / total;
                let f = c as f64 / DRAWS as f64;
                let se = (p * (1.0 - p) / DRAWS as f64).sqrt();
                assert!(
                    (f - p).abs() <= 5.0 * se + 1e-4,
                    "T{temperature} min-p {min_p}: token {t} drawn {f}, p {p}"
                );
            }
        }
    }
}
