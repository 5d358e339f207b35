//! The forward entry points: a block top to bottom ([`Decoder::block`]), layer ranges (the
//! pieces skip-and-fill and calibration compose), full prefill, decode, batched prefill and
//! decode of several sequences, and teacher-forced scoring.

use std::ops::Range;

use burn::tensor::{FloatDType, Int, Tensor, TensorData, activation};

use super::{At, Decoder, PREFILL_CHUNK};
use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::weight::Rows;

impl Decoder {
    /// Token embeddings.
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[n, hidden]`
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor<2>> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id, vocab });
        }
        let x = self
            .embed_tokens
            .gather_rows(tokens, &self.device, self.dtype);
        Ok(match self.config.embed_scale {
            // HF rounds the scale to the activation dtype before multiplying (Gemma).
            Some(s) => {
                let s = Tensor::<1>::from_data(TensorData::new(vec![s as f32], [1]), &self.device)
                    .cast(self.dtype);
                x * s.unsqueeze_dim::<2>(0)
            }
            None => x,
        })
    }

    /// RMSNorm, computed in f32 whatever the activation dtype (f16 squares overflow).
    ///
    /// # Shapes
    /// - x: `[n, hidden]`, weight: `[hidden]` → `[n, hidden]`
    pub fn rms_norm(&self, x: Tensor<2>, weight: Option<&Tensor<1>>) -> Tensor<2> {
        #[cfg(feature = "flex")]
        if let (true, Some(w)) = (self.cpu_kernels, weight) {
            return crate::cpu::rms_norm(x, w, self.config.rms_norm_eps);
        }
        let half = self.dtype != FloatDType::F32;
        let x32 = if half { x.cast(FloatDType::F32) } else { x };
        let eps = self.config.rms_norm_eps;
        let inv = x32
            .clone()
            .square()
            .mean_dim(1)
            .add_scalar(eps)
            .sqrt()
            .recip();
        let y = x32 * inv;
        let y = if half { y.cast(self.dtype) } else { y };
        match weight {
            Some(w) => y * w.clone().unsqueeze_dim::<2>(0),
            None => y,
        }
    }

    /// One decoder block; also returns the rows' pre-RoPE K/V, `[m, 2·kv_dim]`.
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → (`[m, hidden]`, `[m, 2·kv_dim]`)
    pub(crate) fn block(
        &self,
        l: usize,
        h: Tensor<2>,
        cache: &mut KvCache,
        at: At,
    ) -> (Tensor<2>, Tensor<2>) {
        let qkv = self.qkv(l, h.clone(), Rows::Prompt);
        self.block_qkv(l, h, qkv, cache, at)
    }

    /// The rest of the block once the rows' Q/K/V projection is known: RoPE, cache write,
    /// attention, MLP. Also returns the rows' pre-RoPE K/V.
    ///
    /// # Shapes
    /// - h: `[m, hidden]`, qkv: `[m, q_dim + 2·kv_dim]` → (`[m, hidden]`, `[m, 2·kv_dim]`)
    pub(crate) fn block_qkv(
        &self,
        l: usize,
        h: Tensor<2>,
        qkv: Tensor<2>,
        cache: &mut KvCache,
        at: At,
    ) -> (Tensor<2>, Tensor<2>) {
        let (attn, kv_pre) = self.attention_rows(l, qkv, cache, at);
        (self.block_after_attention(l, h, attn, Rows::Prompt), kv_pre)
    }

    /// Final norm and output head.
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, vocab]`
    pub fn head(&self, h: Tensor<2>) -> Tensor<2> {
        let logits = self.linear(
            self.rms_norm(h, Some(&self.norm)),
            &self.lm_head,
            Rows::Fastest,
        );
        match self.config.final_logit_softcapping {
            Some(cap) => super::attention::softcap(logits, cap),
            None => logits,
        }
    }

    /// Runs `layers` over rows at consecutive positions `pos..pos+m`, appending their K/V to each
    /// layer's cache slots and attending to everything that layer holds (which must precede them).
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, hidden]`
    pub fn forward_layers(
        &self,
        h: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
        pos: usize,
    ) -> Result<Tensor<2>> {
        self.run_layers(h, layers, cache, pos, None)
    }

    /// As [`Decoder::forward_layers`], also returning each layer's pre-RoPE K and V (calibration
    /// targets).
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → (`[m, hidden]`, per layer `[m, 2·kv_dim]`: K columns then V columns)
    pub fn forward_layers_capturing(
        &self,
        h: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
        pos: usize,
    ) -> Result<(Tensor<2>, Vec<Tensor<2>>)> {
        let mut kv = Vec::with_capacity(layers.len());
        let h = self.run_layers(h, layers, cache, pos, Some(&mut kv))?;
        Ok((h, kv))
    }

    pub(crate) fn run_layers(
        &self,
        mut h: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
        pos: usize,
        mut capture: Option<&mut Vec<Tensor<2>>>,
    ) -> Result<Tensor<2>> {
        let m = h.dims()[0];
        let needed = layers
            .clone()
            .map(|l| cache.layer_len(l) + m)
            .max()
            .unwrap_or(0);
        if needed > cache.capacity() {
            return Err(ModelError::CacheFull {
                capacity: cache.capacity(),
                needed,
            });
        }
        if pos + m > self.rope.max_positions() {
            return Err(ModelError::CacheFull {
                capacity: self.rope.max_positions(),
                needed: pos + m,
            });
        }
        for l in layers {
            let (next, kv) = self.block(l, h, cache, At::Next(pos));
            h = next;
            if let Some(c) = capture.as_deref_mut() {
                c.push(kv);
            }
        }
        Ok(h)
    }

    /// Full prefill of `tokens` after the cache's current contents; returns last-position logits.
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[vocab]`
    pub fn prefill(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<1>> {
        let mut last = None;
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            let h = self.forward_rows(chunk, cache)?;
            last = Some(h.narrow(0, chunk.len() - 1, 1));
        }
        let last = last.ok_or(ModelError::EmptyInput)?;
        Ok(self.head(last).reshape([self.config.vocab_size]))
    }

    /// Prefill returning logits for every position (teacher-forced scoring).
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[n, vocab]`
    pub fn forward_all_logits(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<2>> {
        let h = self.forward_rows(tokens, cache)?;
        Ok(self.head(h))
    }

    /// One decode step; returns the next-token logits.
    pub fn decode_step(&self, token: u32, cache: &mut KvCache) -> Result<Tensor<1>> {
        self.prefill(&[token], cache)
    }

    /// One decode step of several sequences at once, `tokens[i]` appended to `caches[i]`: every
    /// projection and the MLP run as one `[b, ·]` matmul over all of them (the weights are read
    /// once per step, not once per sequence); attention runs per sequence on its own cache.
    /// Row `i` equals [`Decoder::decode_step`] of sequence `i` alone.
    ///
    /// # Shapes
    /// - tokens: `[b]` → `[b, vocab]`
    pub fn decode_batch(&self, tokens: &[u32], caches: &mut [&mut KvCache]) -> Result<Tensor<2>> {
        let rows: Vec<&[u32]> = tokens.chunks(1).collect();
        self.forward_batch(&rows, caches, Rows::Fastest)
    }

    /// Prefill of several prompts at once, each continuing its own cache: round `k` takes chunk
    /// `k` ([`PREFILL_CHUNK`] tokens) of every prompt that has one, and runs those rows together
    /// ([`Decoder::forward_batch`]). Row `i` of the result equals [`Decoder::prefill`] of prompt `i`
    /// alone.
    ///
    /// # Shapes
    /// - prompts: `b` prompts of `n_i ≥ 1` tokens → `[b, vocab]`, the logits after each one
    pub fn prefill_batch(
        &self,
        prompts: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor<2>> {
        if prompts.is_empty() || prompts.len() != caches.len() {
            return Err(ModelError::Invalid(format!(
                "prefill_batch: {} prompts for {} caches",
                prompts.len(),
                caches.len()
            )));
        }
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(ModelError::EmptyInput);
        }
        let rounds = prompts
            .iter()
            .map(|p| p.len().div_ceil(PREFILL_CHUNK))
            .max();
        let mut last: Vec<Option<Tensor<2>>> = vec![None; prompts.len()];
        let chunk_of = |i: usize, k: usize| {
            let p = prompts[i];
            &p[(k * PREFILL_CHUNK).min(p.len())..((k + 1) * PREFILL_CHUNK).min(p.len())]
        };
        for k in 0..rounds.unwrap_or(0) {
            // Chunks of fewer than REUSE_FLOOR_ROWS rows run alone on the decode rows' kernels,
            // longer ones on a long prompt's: each group runs as its prompts would alone.
            for short in [false, true] {
                let live: Vec<usize> = (0..prompts.len())
                    .filter(|&i| {
                        let m = chunk_of(i, k).len();
                        m > 0 && (m < super::REUSE_FLOOR_ROWS) == short
                    })
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let chunks: Vec<&[u32]> = live.iter().map(|&i| chunk_of(i, k)).collect();
                let mut cs: Vec<&mut KvCache> = caches
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| live.contains(i))
                    .map(|(_, c)| &mut **c)
                    .collect();
                let rows = if short { Rows::Fastest } else { Rows::Prompt };
                let logits = self.forward_batch(&chunks, &mut cs, rows)?;
                for (j, &i) in live.iter().enumerate() {
                    last[i] = Some(logits.clone().narrow(0, j, 1));
                }
            }
        }
        let last: Vec<Tensor<2>> = last.into_iter().flatten().collect();
        Ok(Tensor::cat(last, 0))
    }

    /// New rows of several sequences at once, `tokens[i]` appended to `caches[i]` (a prompt
    /// chunk, or one decode token): every projection and the MLP run as one matmul over all the
    /// rows (the weights are read once, not once per sequence); attention runs per sequence on
    /// its own cache. Row `i` of the result equals running `tokens[i]` alone. `rows`: decode
    /// rows or prompt chunks, for the quantised kernels' path.
    ///
    /// # Shapes
    /// - tokens: `b` slices of `n_i ≥ 1` tokens → `[b, vocab]`, the logits after each slice
    pub fn forward_batch(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
        rows: Rows,
    ) -> Result<Tensor<2>> {
        if tokens.is_empty() || tokens.len() != caches.len() || tokens.iter().any(|t| t.is_empty())
        {
            return Err(ModelError::Invalid(format!(
                "forward_batch: {} token slices (none may be empty) for {} caches",
                tokens.len(),
                caches.len()
            )));
        }
        for (t, c) in tokens.iter().zip(caches.iter()) {
            let needed = c.len() + t.len();
            if needed > c.capacity() || needed > self.rope.max_positions() {
                return Err(ModelError::CacheFull {
                    capacity: c.capacity().min(self.rope.max_positions()),
                    needed,
                });
            }
        }
        let ns: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let mut h = self.embed(&tokens.concat())?;
        for l in 0..self.num_layers() {
            let qkv = self.qkv(l, h.clone(), rows);
            let attn = self.attention_batch(l, qkv, &ns, caches);
            h = self.block_after_attention(l, h, attn, rows);
        }
        for (c, n) in caches.iter_mut().zip(&ns) {
            let len = c.len() + n;
            c.set_len(len);
        }
        // Each sequence's last row.
        let mut end = 0;
        let last: Vec<Tensor<2>> = ns
            .iter()
            .map(|n| {
                end += n;
                h.clone().narrow(0, end - 1, 1)
            })
            .collect();
        Ok(self.head(Tensor::cat(last, 0)))
    }

    pub(crate) fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<2>> {
        let pos = cache.len();
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, 0..self.num_layers(), cache, pos)?;
        cache.set_len(pos + tokens.len());
        Ok(h)
    }

    /// Negative log-likelihood of each token after the first, predicted from its prefix.
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[n - 1]`
    pub fn token_nll(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n < 2 {
            return Ok(Vec::new());
        }
        let logits = self.forward_all_logits(&tokens[..n - 1], cache)?;
        let logp = activation::log_softmax(logits.cast(FloatDType::F32), 1);
        let targets: Vec<i32> = tokens[1..].iter().map(|&t| t as i32).collect();
        let targets =
            Tensor::<2, Int>::from_data(TensorData::new(targets, [n - 1, 1]), &self.device);
        let picked = logp.gather(1, targets).neg();
        Ok(crate::to_host_f32(picked))
    }
}
