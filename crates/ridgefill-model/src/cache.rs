//! Preallocated KV cache kept outside the model, one K and one V tensor per layer.

use burn::tensor::{Device, FloatDType, Tensor, s};

/// K/V for every layer, shape `[1, kv_heads, capacity, head_dim]`, valid up to `len`.
pub struct KvCache {
    pub k: Vec<Tensor<4>>,
    pub v: Vec<Tensor<4>>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Self {
        let zeros = || Tensor::<4>::zeros([1, kv_heads, capacity, head_dim], device).cast(dtype);
        Self {
            k: (0..layers).map(|_| zeros()).collect(),
            v: (0..layers).map(|_| zeros()).collect(),
            len: 0,
            capacity,
        }
    }

    /// Number of positions already written for every layer.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Marks positions `..len` valid (callers write every layer before advancing).
    pub fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }

    /// Forgets everything; the storage is kept for the next sequence.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Writes `k`, `v` (`[1, kv_heads, m, head_dim]`) for `layer` at positions `pos..pos+m`.
    pub fn write(&mut self, layer: usize, pos: usize, k: Tensor<4>, v: Tensor<4>) {
        let m = k.dims()[2];
        let kc = std::mem::replace(&mut self.k[layer], k.clone());
        self.k[layer] = kc.slice_assign(s![.., .., pos..pos + m, ..], k);
        let vc = std::mem::replace(&mut self.v[layer], v.clone());
        self.v[layer] = vc.slice_assign(s![.., .., pos..pos + m, ..], v);
    }

    /// K and V of `layer` for positions `0..end`.
    pub fn read(&self, layer: usize, end: usize) -> (Tensor<4>, Tensor<4>) {
        (
            self.k[layer].clone().narrow(2, 0, end),
            self.v[layer].clone().narrow(2, 0, end),
        )
    }
}
