//! Skip-and-fill prefill: the bulk of the prompt runs layers `0..split` only, and the upper
//! layers' K/V for those rows are predicted by linear maps from the hidden state entering `split`.

use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::llama::Llama;

/// All upper layers' fill maps as one matrix, so the bulk fill is a single GEMM.
pub struct FillMaps {
    /// First skipped layer.
    pub split: usize,
    /// `[hidden + 1, (layers - split) · 2 · kv_dim]`: per layer, K columns then V columns.
    pub w: Tensor<2>,
}

/// Which rows of the prompt run every layer exactly.
#[derive(Clone, Copy, Debug)]
pub struct FillRows {
    /// First tokens (attention sinks) computed exactly.
    pub sink: usize,
    /// Last tokens computed exactly; the first generated token comes from the last of them.
    pub tail: usize,
}

impl Default for FillRows {
    fn default() -> Self {
        Self { sink: 1, tail: 16 }
    }
}

impl FillMaps {
    /// Builds the fused matrix from per-layer host maps `k[l]`, `v[l]`, each `[hidden + 1, kv_dim]`
    /// row-major, for layers `split..layers`.
    pub fn from_host(
        split: usize,
        hidden: usize,
        kv_dim: usize,
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        dtype: FloatDType,
        device: &Device,
    ) -> Result<Self> {
        if k.len() != v.len() || k.is_empty() {
            return Err(ModelError::Invalid(format!(
                "fill maps: {} K maps and {} V maps (need the same, non-zero number)",
                k.len(),
                v.len()
            )));
        }
        let rows = hidden + 1;
        let upper = k.len();
        let cols = upper * 2 * kv_dim;
        let mut w = vec![0.0f32; rows * cols];
        for (li, (kl, vl)) in k.iter().zip(v).enumerate() {
            for (which, m) in [kl, vl].into_iter().enumerate() {
                if m.len() != rows * kv_dim {
                    return Err(ModelError::Invalid(format!(
                        "fill map for layer {}: {} values, expected {rows}×{kv_dim}",
                        split + li,
                        m.len()
                    )));
                }
                let col0 = (li * 2 + which) * kv_dim;
                for r in 0..rows {
                    w[r * cols + col0..r * cols + col0 + kv_dim]
                        .copy_from_slice(&m[r * kv_dim..(r + 1) * kv_dim]);
                }
            }
        }
        Ok(Self {
            split,
            w: Tensor::<2>::from_data(TensorData::new(w, [rows, cols]), device).cast(dtype),
        })
    }
}

impl Llama {
    /// Features the fill maps read: `[rmsnorm(h) without its weight, 1]`.
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, hidden + 1]`
    pub fn fill_features(&self, h: Tensor<2>) -> Tensor<2> {
        let m = h.dims()[0];
        let ones = Tensor::<2>::ones([m, 1], &self.device).cast(self.dtype);
        Tensor::cat(vec![self.rms_norm(h, None), ones], 1)
    }

    /// Training-free maps from each upper layer's own K/V projection applied to its input-normed
    /// `h_split` (the starting point of SwiftKV): `W_l = diag(g_l) · [Wk_l | Wv_l]`, no intercept.
    pub fn own_proj_maps(&self, split: usize) -> Result<FillMaps> {
        self.check_split(split)?;
        let (q_dim, kv_dim) = (self.config.q_dim(), self.config.kv_dim());
        let zero_row = Tensor::<2>::zeros([1, 2 * kv_dim], &self.device).cast(self.dtype);
        let cols: Vec<Tensor<2>> = self.layers[split..]
            .iter()
            .map(|layer| {
                let g = layer.input_layernorm.clone().unsqueeze_dim::<2>(1);
                let w = layer.qkv_proj.clone().narrow(1, q_dim, 2 * kv_dim) * g;
                Tensor::cat(vec![w, zero_row.clone()], 0)
            })
            .collect();
        Ok(FillMaps {
            split,
            w: Tensor::cat(cols, 1),
        })
    }

    fn check_split(&self, split: usize) -> Result<()> {
        let layers = self.num_layers();
        if split == 0 || split >= layers {
            return Err(ModelError::Invalid(format!(
                "split {split} is out of range for a {layers}-layer model (need 0 < split < {layers})"
            )));
        }
        Ok(())
    }

    /// Appends predicted K (rotated at each row's own position) and V to layers `split..L`.
    ///
    /// # Shapes
    /// - h_split: `[b, hidden]` rows at positions `pos..pos+b`
    pub fn fill_cache(&self, maps: &FillMaps, h_split: Tensor<2>, cache: &mut KvCache, pos: usize) {
        let upper = self.num_layers() - maps.split;
        let b = h_split.dims()[0];
        // One GEMM for every upper layer's K and V.
        let y = self.linear(self.fill_features(h_split), &maps.w);
        let (k, v) = self.split_fill(y, upper, b, pos);
        for i in 0..upper {
            let kl = k.clone().narrow(0, i, 1);
            let vl = v.clone().narrow(0, i, 1);
            cache.append(maps.split + i, kl, vl);
        }
    }

    /// Every upper layer's K, rotated at its row's position, and V out of the fill GEMM's output.
    ///
    /// # Shapes
    /// - y: `[b, upper·2·kv_heads·hd]` → k and v `[upper, kv_heads, b, hd]`
    fn split_fill(
        &self,
        y: Tensor<2>,
        upper: usize,
        b: usize,
        pos: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let (kvh, hd) = (self.config.num_key_value_heads, self.config.head_dim());
        #[cfg(feature = "flex")]
        if self.cpu_kernels {
            return crate::cpu::fill_kv(y, upper, kvh, hd, self.rope.host(pos));
        }
        // [b, upper·2·kvh, hd] → [upper, 2, kvh, b, hd]
        let y = y
            .reshape([b, upper * 2 * kvh, hd])
            .swap_dims(0, 1)
            .reshape([upper, 2, kvh, b, hd]);
        let k = y.clone().narrow(1, 0, 1).reshape([1, upper * kvh, b, hd]);
        let v = y.narrow(1, 1, 1).reshape([upper, kvh, b, hd]);
        // One RoPE op over every upper layer's keys.
        let k = self.rope.apply(k, pos).reshape([upper, kvh, b, hd]);
        (k, v)
    }

    /// Skip-and-fill prefill of `tokens` into an empty cache; returns last-position logits.
    ///
    /// With `sink + tail ≥ n` every row runs every layer and this equals [`Llama::prefill`].
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[vocab]`
    pub fn prefill_fill(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        maps: &FillMaps,
        rows: FillRows,
    ) -> Result<Tensor<1>> {
        self.prefill_skip(tokens, cache, maps.split, Some(maps), rows)
    }

    /// Skips layers `split..L` for the bulk rows; `maps` fills their K/V, or with `None` the upper
    /// layers never see the bulk (the `drop` baseline: their cache holds sink and tail only).
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[vocab]`
    pub fn prefill_skip(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        split: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
    ) -> Result<Tensor<1>> {
        if !cache.is_empty() {
            return Err(ModelError::Invalid(
                "skip-and-fill prefill needs an empty cache".into(),
            ));
        }
        self.check_split(split)?;
        let n = tokens.len();
        let layers = self.num_layers();
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, 0..split, cache, 0)?;
        let sink = rows.sink.min(n);
        let h_last = if sink + rows.tail >= n {
            self.forward_layers(h, split..layers, cache, 0)?
                .narrow(0, n - 1, 1)
        } else {
            let tail0 = n - rows.tail;
            if sink > 0 {
                self.forward_layers(h.clone().narrow(0, 0, sink), split..layers, cache, 0)?;
            }
            if let Some(maps) = maps {
                self.fill_cache(maps, h.clone().narrow(0, sink, tail0 - sink), cache, sink);
            }
            let t =
                self.forward_layers(h.narrow(0, tail0, rows.tail), split..layers, cache, tail0)?;
            t.narrow(0, rows.tail - 1, 1)
        };
        cache.set_len(n);
        Ok(self.head(h_last).reshape([self.config.vocab_size]))
    }
}
