//! Preallocated KV cache kept outside the model, one K and one V tensor per layer.
//!
//! Each layer keeps its own count of filled slots: usually every layer holds one slot per
//! position, but a layer that skipped rows (the `drop` baseline) holds fewer. Keys are rotated
//! at their true positions before they are written, so a slot's index need not equal its position.

use burn::tensor::{Device, FloatDType, Tensor, s};

/// K/V for every layer, shape `[1, kv_heads, capacity, head_dim]`, slots `..lens[l]` valid.
/// A clone shares storage until either side writes (writes copy a shared buffer).
///
/// The storage dtype may be narrower than the activations' (f16 under f32 on the fused CPU
/// path): writes round to it, [`KvCache::read`] widens back, [`KvCache::read_stored`] does not.
#[derive(Clone)]
pub struct KvCache {
    pub k: Vec<Tensor<4>>,
    pub v: Vec<Tensor<4>>,
    lens: Vec<usize>,
    /// Positions of the sequence processed so far.
    len: usize,
    capacity: usize,
    /// The activations' dtype, which [`KvCache::read`] returns.
    dtype: FloatDType,
    /// What K and V are stored as.
    stored: FloatDType,
}

impl KvCache {
    /// A cache storing K/V at the activations' `dtype`.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Self {
        Self::with_storage(layers, kv_heads, head_dim, capacity, dtype, dtype, device)
    }

    /// A cache storing K/V as `stored` for activations of `dtype`.
    pub fn with_storage(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: FloatDType,
        stored: FloatDType,
        device: &Device,
    ) -> Self {
        let zeros = || Tensor::<4>::zeros([1, kv_heads, capacity, head_dim], device).cast(stored);
        Self {
            k: (0..layers).map(|_| zeros()).collect(),
            v: (0..layers).map(|_| zeros()).collect(),
            lens: vec![0; layers],
            len: 0,
            capacity,
            dtype,
            stored,
        }
    }

    /// Bytes of K and V storage, every layer at its whole capacity.
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|t| t.dims().iter().product::<usize>() * t.dtype().size())
            .sum()
    }

    /// The dtype K and V are stored as.
    pub fn stored_dtype(&self) -> FloatDType {
        self.stored
    }

    /// Positions of the sequence processed so far (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Filled slots of `layer`.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.lens[layer]
    }

    /// Marks the sequence as processed up to `len` (callers write every layer first).
    pub fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }

    /// Room for at least `capacity` positions, keeping every cached slot (a cache reused for a
    /// longer request).
    pub fn grow(&mut self, capacity: usize) {
        if capacity <= self.capacity {
            return;
        }
        let extra = capacity - self.capacity;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let [b, h, _, d] = t.dims();
            let zeros = Tensor::<4>::zeros([b, h, extra, d], &t.device()).cast(self.stored);
            *t = Tensor::cat(vec![t.clone(), zeros], 2);
        }
        self.capacity = capacity;
    }

    /// Forgets everything; the storage is kept for the next sequence.
    pub fn reset(&mut self) {
        self.len = 0;
        self.lens.iter_mut().for_each(|l| *l = 0);
    }

    /// Forgets every slot of `layer` (a prefill that re-runs it from the first row).
    pub fn clear_layer(&mut self, layer: usize) {
        self.lens[layer] = 0;
    }

    /// Forgets `layer`'s slots from `len` on (a prefill that re-runs its newer rows).
    pub fn truncate_layer(&mut self, layer: usize, len: usize) {
        self.lens[layer] = self.lens[layer].min(len);
    }

    /// Forgets positions from `len` on, keeping the prefix (e.g. to re-run the same decode step).
    /// Only for caches whose layers hold one slot per position (full prefill).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        self.lens.iter_mut().for_each(|l| *l = (*l).min(len));
    }

    /// Appends `k`, `v` (`[1, kv_heads, m, head_dim]`) to `layer`'s filled slots.
    pub fn append(&mut self, layer: usize, k: Tensor<4>, v: Tensor<4>) {
        let (k, v) = (self.narrow_to_stored(k), self.narrow_to_stored(v));
        let m = k.dims()[2];
        let at = self.lens[layer];
        // Take the old handle so the backend may update the buffer in place.
        let kc = std::mem::replace(&mut self.k[layer], k.clone());
        self.k[layer] = kc.slice_assign(s![.., .., at..at + m, ..], k);
        let vc = std::mem::replace(&mut self.v[layer], v.clone());
        self.v[layer] = vc.slice_assign(s![.., .., at..at + m, ..], v);
        self.lens[layer] = at + m;
    }

    /// Appends `m` slots to `layer`, written by `write` straight into the storage: it gets the
    /// layer's K and V by value (unshared, so a backend can write in place) and the first slot,
    /// and returns them.
    pub fn append_with(
        &mut self,
        layer: usize,
        m: usize,
        write: impl FnOnce(Tensor<4>, Tensor<4>, usize) -> (Tensor<4>, Tensor<4>),
    ) {
        let at = self.lens[layer];
        assert!(
            at + m <= self.capacity,
            "KV cache overflow in layer {layer}"
        );
        let device = self.k[layer].device();
        let empty = || Tensor::<4>::empty([0, 0, 0, 0], &device);
        let k = std::mem::replace(&mut self.k[layer], empty());
        let v = std::mem::replace(&mut self.v[layer], empty());
        let (k, v) = write(k, v, at);
        (self.k[layer], self.v[layer]) = (k, v);
        self.lens[layer] = at + m;
    }

    /// Counts `m` more slots of `layer` as filled without writing them: for slots no query
    /// reads (masked out of a sliding window), which keep whatever the storage holds.
    pub fn reserve(&mut self, layer: usize, m: usize) {
        debug_assert!(self.lens[layer] + m <= self.capacity);
        self.lens[layer] += m;
    }

    /// Overwrites `layer`'s filled slots `at..at+m` with `k`, `v` (`[1, kv_heads, m, head_dim]`).
    pub fn overwrite(&mut self, layer: usize, at: usize, k: Tensor<4>, v: Tensor<4>) {
        let (k, v) = (self.narrow_to_stored(k), self.narrow_to_stored(v));
        let m = k.dims()[2];
        debug_assert!(at + m <= self.lens[layer]);
        let kc = std::mem::replace(&mut self.k[layer], k.clone());
        self.k[layer] = kc.slice_assign(s![.., .., at..at + m, ..], k);
        let vc = std::mem::replace(&mut self.v[layer], v.clone());
        self.v[layer] = vc.slice_assign(s![.., .., at..at + m, ..], v);
    }

    /// K and V of `layer`'s filled slots at the activations' dtype (a widened copy when the
    /// storage is narrower).
    pub fn read(&self, layer: usize) -> (Tensor<4>, Tensor<4>) {
        let (k, v) = self.read_stored(layer);
        if self.stored == self.dtype {
            return (k, v);
        }
        (k.cast(self.dtype), v.cast(self.dtype))
    }

    /// K and V of `layer`'s filled slots as stored (views, no copy).
    pub fn read_stored(&self, layer: usize) -> (Tensor<4>, Tensor<4>) {
        let end = self.lens[layer];
        (
            self.k[layer].clone().narrow(2, 0, end),
            self.v[layer].clone().narrow(2, 0, end),
        )
    }

    fn narrow_to_stored(&self, x: Tensor<4>) -> Tensor<4> {
        if self.stored == self.dtype {
            x
        } else {
            x.cast(self.stored)
        }
    }
}
