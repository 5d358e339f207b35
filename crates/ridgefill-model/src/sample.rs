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
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i as u32, x * inv_t))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 {
            cand.truncate(self.cfg.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, x)| (x - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        // min-p: drop tokens below min_p × the top probability.
        let mut keep = probs.len();
        if self.cfg.min_p > 0.0 {
            let floor = self.cfg.min_p * probs[0];
            keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        }
        // top-p: smallest prefix whose mass reaches top_p.
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &p in &probs[..keep] {
                acc += p;
                n += 1;
                if acc >= self.cfg.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &p) in probs[..keep].iter().enumerate() {
            if r < p {
                return cand[i].0;
            }
            r -= p;
        }
        cand[keep - 1].0
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
}
