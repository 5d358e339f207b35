//! Timing the modes of `bench`: random prompts, full and skip-and-fill prefill, batched decode,
//! and repetitions with the modes alternating.

use std::time::Instant;

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ridgefill::model::fill::{FillMaps, FillOptions, FillRows, Prefill};
use ridgefill::model::{Decoder, KvCache, sample, to_host_f32};

/// Seed for the random prompt ids; every run draws new ids so nothing is cached by accident.
const PROMPT_SEED: u64 = 1234;
/// Token ids below this are control and special tokens in Llama-family vocabularies.
const FIRST_PLAIN_ID: u32 = 100;

/// One measured mode of one test: seconds per run.
pub(super) struct Series {
    pub(super) secs: Vec<f64>,
}

/// The modes compared on a device.
pub(super) struct Modes<'a> {
    pub(super) fill: Option<(&'a FillMaps, &'static str)>,
    /// The same maps filling sliding-window layers' unread rows too, when the model has such
    /// layers above the split: prefill rows show what leaving them out saves.
    pub(super) fill_unread: Option<FillMaps>,
    pub(super) rows: FillRows,
}

impl Modes<'_> {
    /// Full, then fill, then (for prefill tests) fill of every row.
    pub(super) fn list(&self, prefill: bool) -> Vec<Option<&FillMaps>> {
        let mut v = vec![None];
        if let Some((m, _)) = self.fill {
            v.push(Some(m));
        }
        if let (true, Some(m)) = (prefill, &self.fill_unread) {
            v.push(Some(m));
        }
        v
    }
}

/// Times runs of one model, drawing new prompt ids for each.
pub(super) struct Runner<'a> {
    model: &'a Decoder,
    rng: StdRng,
    cache: KvCache,
}

impl<'a> Runner<'a> {
    /// A runner with a cache of `capacity` positions and the fixed prompt seed.
    pub(super) fn new(model: &'a Decoder, capacity: usize) -> Self {
        Runner {
            model,
            rng: StdRng::seed_from_u64(PROMPT_SEED),
            cache: model.new_cache(capacity),
        }
    }

    fn ids(&mut self, n: usize) -> Vec<u32> {
        let vocab = self.model.config.vocab_size as u32;
        (0..n)
            .map(|_| self.rng.random_range(FIRST_PLAIN_ID.min(vocab - 1)..vocab))
            .collect()
    }

    /// Prefills `ids` into the (reset) cache by `maps`' mode; returns the first token, on the host.
    fn prefill(&mut self, ids: &[u32], maps: Option<&FillMaps>, rows: FillRows) -> Result<u32> {
        self.cache.reset();
        let logits = match maps {
            None => self.model.prefill(ids, &mut self.cache)?,
            Some(m) => filled(Prefill::run(
                self.model,
                ids,
                &mut self.cache,
                FillOptions::fill(m, rows),
            )?)?,
        };
        Ok(sample::argmax(&to_host_f32(logits)))
    }

    /// Seconds from prompt ids to the first sampled token.
    fn time_pp(&mut self, n: usize, maps: Option<&FillMaps>, rows: FillRows) -> Result<f64> {
        let ids = self.ids(n);
        let t = Instant::now();
        self.prefill(&ids, maps, rows)?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds from `batch` prompts of `n` ids to all their first tokens: full prefill as one
    /// batch (every weight pass shared), skip-and-fill prompt after prompt; one prompt as
    /// [`Runner::time_pp`].
    pub(super) fn time_pp_batch(
        &mut self,
        n: usize,
        batch: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        if batch == 1 {
            return self.time_pp(n, maps, rows);
        }
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| self.ids(n)).collect();
        let mut caches: Vec<KvCache> = (0..batch).map(|_| self.model.new_cache(n)).collect();
        let t = Instant::now();
        let first: Vec<u32> = match maps {
            None => {
                let ps: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let logits = to_host_f32(self.model.prefill_batch(&ps, &mut refs)?);
                logits
                    .chunks_exact(self.model.config.vocab_size)
                    .map(sample::argmax)
                    .collect()
            }
            Some(m) => prompts
                .iter()
                .zip(&mut caches)
                .map(|(p, c)| {
                    let l = filled(Prefill::run(self.model, p, c, FillOptions::fill(m, rows))?)?;
                    Ok(sample::argmax(&to_host_f32(l)))
                })
                .collect::<Result<_>>()?,
        };
        let secs = t.elapsed().as_secs_f64();
        debug_assert_eq!(first.len(), batch);
        Ok(secs)
    }

    /// Seconds from `n` new prompt ids to the first sampled token when the cache already holds
    /// `depth` positions (prefilled untimed by the same mode), and the earlier rows the new ones
    /// re-ran: full prefill continues the cache; skip-and-fill resumes over the filled prefix
    /// ([`Prefill::over`]), re-running the spans its new rows choose among the filled ones.
    pub(super) fn time_pp_depth(
        &mut self,
        depth: usize,
        n: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<(f64, usize)> {
        self.cache.reset();
        let mut ids = self.ids(depth);
        let history = match maps {
            None => {
                self.model.prefill(&ids, &mut self.cache)?;
                None
            }
            Some(m) => {
                let mut f = Prefill::run(
                    self.model,
                    &ids,
                    &mut self.cache,
                    FillOptions::fill(m, rows),
                )?;
                let history = f.history.take();
                filled(f)?;
                history
            }
        };
        let new = self.ids(n);
        ids.extend_from_slice(&new);
        let t = Instant::now();
        let (logits, restored) = match maps {
            None => (self.model.prefill(&new, &mut self.cache)?, 0),
            Some(m) => {
                let opts = FillOptions::fill(m, rows);
                let f = Prefill::over(self.model, &ids, &self.cache, history, opts)?
                    .finish(&mut self.cache)?;
                let restored = f.report.restored;
                (filled(f)?, restored)
            }
        };
        sample::argmax(&to_host_f32(logits));
        Ok((t.elapsed().as_secs_f64(), restored))
    }

    /// Seconds for `n_gen` batched greedy decode steps of `batch` sequences, each after an
    /// untimed prefill of its own `depth` tokens.
    pub(super) fn time_tg_batch(
        &mut self,
        depth: usize,
        n_gen: usize,
        batch: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        if batch == 1 {
            return self.time_tg(depth, n_gen, maps, rows);
        }
        let mut caches = Vec::with_capacity(batch);
        let mut next = Vec::with_capacity(batch);
        for _ in 0..batch {
            let ids = self.ids(depth.max(1));
            next.push(self.prefill(&ids, maps, rows)?);
            caches.push(std::mem::replace(
                &mut self.cache,
                self.model.new_cache(depth.max(1) + n_gen),
            ));
        }
        let vocab = self.model.config.vocab_size;
        let t = Instant::now();
        for _ in 0..n_gen {
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let logits = to_host_f32(self.model.decode_batch(&next, &mut refs)?);
            for (i, n) in next.iter_mut().enumerate() {
                *n = sample::argmax(&logits[i * vocab..(i + 1) * vocab]);
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds for `n_gen` greedy decode steps after an untimed prefill of `depth` tokens.
    fn time_tg(
        &mut self,
        depth: usize,
        n_gen: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<f64> {
        let ids = self.ids(depth.max(1));
        let mut next = self.prefill(&ids, maps, rows)?;
        let t = Instant::now();
        for _ in 0..n_gen {
            next = sample::argmax(&to_host_f32(self.model.decode_step(next, &mut self.cache)?));
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Runs `run` for every mode, alternating the order each repetition so drift hits both alike.
pub(super) fn alternate(
    modes: &Modes,
    prefill: bool,
    reps: usize,
    mut run: impl FnMut(Option<&FillMaps>) -> Result<f64>,
) -> Result<Vec<Series>> {
    let list = modes.list(prefill);
    for m in &list {
        run(*m)?; // warm-up: kernels compiled and autotuned, buffers allocated
    }
    let mut out: Vec<Series> = list.iter().map(|_| Series { secs: Vec::new() }).collect();
    for rep in 0..reps {
        ridgefill::interrupt::check()?;
        let order: Vec<usize> = if rep % 2 == 0 {
            (0..list.len()).collect()
        } else {
            (0..list.len()).rev().collect()
        };
        for i in order {
            out[i].secs.push(run(list[i])?);
        }
    }
    Ok(out)
}

/// A fill prefill's logits, or an error when its self-check ran it exactly: a fill row must
/// time the fill, not full prefill under the fill's name.
fn filled(f: ridgefill::model::fill::Filled) -> Result<ridgefill::model::Tensor<1>> {
    if f.report.fell_back {
        anyhow::bail!(
            "bench: the fill's self-check ran the prompt exactly (error {:?}); the fill row would time full prefill",
            f.report.error
        );
    }
    Ok(f.logits)
}
