//! Rotary position embedding, Hugging Face rotate-half convention (GGUF Q/K rows are un-permuted
//! on load, so one convention serves every format).

use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};

/// Precomputed cos/sin tables, `[max_positions, head_dim]`.
pub struct Rope {
    cos: Tensor<2>,
    sin: Tensor<2>,
    /// The same tables on the host, for the fused CPU kernels.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    cos_host: Vec<f32>,
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    sin_host: Vec<f32>,
    head_dim: usize,
    max_positions: usize,
}

/// Inverse frequencies `1 / θ^(2i/d)`, each divided by its long-context divisor when given.
pub fn inv_freq(head_dim: usize, theta: f64, divisors: Option<&[f64]>) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            divisors.and_then(|d| d.get(i)).map_or(f, |d| f / d)
        })
        .collect()
}

impl Rope {
    pub fn new(
        head_dim: usize,
        theta: f64,
        divisors: Option<&[f64]>,
        max_positions: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Self {
        let freqs = inv_freq(head_dim, theta, divisors);
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for p in 0..max_positions {
            // HF computes the angle in f32 after an f32 product; mirror it for bit-level parity.
            for _half in 0..2 {
                for f in freqs.iter().take(half) {
                    let angle = (p as f32) * (*f as f32);
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let shape = [max_positions, head_dim];
        Self {
            cos: Tensor::<2>::from_data(TensorData::new(cos.clone(), shape), device).cast(dtype),
            sin: Tensor::<2>::from_data(TensorData::new(sin.clone(), shape), device).cast(dtype),
            cos_host: cos,
            sin_host: sin,
            head_dim,
            max_positions,
        }
    }

    /// The host tables for the fused CPU kernels, rotating rows from position `pos` on.
    #[cfg(feature = "flex")]
    pub fn host(&self, pos: usize) -> crate::cpu::Rotation<'_> {
        self.host_at(pos, &[])
    }

    /// The host tables rotating row `i` at position `at[i]` (at `pos + i` when `at` is empty).
    #[cfg(feature = "flex")]
    pub fn host_at<'a>(&'a self, pos: usize, at: &'a [usize]) -> crate::cpu::Rotation<'a> {
        crate::cpu::Rotation {
            cos: &self.cos_host,
            sin: &self.sin_host,
            pos,
            at,
        }
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates `x` whose rows are the consecutive positions `pos..pos+m`.
    ///
    /// # Shapes
    /// - x: `[1, heads, m, head_dim]` → `[1, heads, m, head_dim]`
    pub fn apply(&self, x: Tensor<4>, pos: usize) -> Tensor<4> {
        let m = x.dims()[2];
        let cos = self.cos.clone().narrow(0, pos, m);
        let sin = self.sin.clone().narrow(0, pos, m);
        self.rotate(x, cos, sin)
    }

    /// Rotates `x` whose row `i` sits at position `at[i]`.
    ///
    /// # Shapes
    /// - x: `[1, heads, m, head_dim]`, at: `[m]` → `[1, heads, m, head_dim]`
    pub fn apply_at(&self, x: Tensor<4>, at: &[usize]) -> Tensor<4> {
        let ids: Vec<i32> = at.iter().map(|&p| p as i32).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [at.len()]), &x.device());
        let cos = self.cos.clone().select(0, ids.clone());
        let sin = self.sin.clone().select(0, ids);
        self.rotate(x, cos, sin)
    }

    /// # Shapes
    /// - x: `[1, heads, m, head_dim]`, cos/sin: `[m, head_dim]` → `[1, heads, m, head_dim]`
    fn rotate(&self, x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
        let cos = cos.unsqueeze_dims::<4>(&[0, 1]);
        let sin = sin.unsqueeze_dims::<4>(&[0, 1]);
        let half = self.head_dim / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos + rotated * sin
    }
}
