//! Sizes and kinds of what a loaded model holds, for `bench`, `info` and the roofline figures.

use std::sync::Arc;

use burn::tensor::FloatDType;
use ridgefill_quant::SimdLevel;

use super::{Block, Decoder, REUSE_FLOOR_ROWS, REUSE_MIN_ROWS};
use crate::weight::Weight;

impl Block {
    /// The block's four projections.
    fn projections(&self) -> [&Weight; 4] {
        [
            &self.qkv_proj,
            &self.o_proj,
            &self.gate_up_proj,
            &self.down_proj,
        ]
    }
}

impl Decoder {
    /// Bytes of K/V cache for `positions` positions at its storage dtype.
    pub fn kv_bytes(&self, positions: usize) -> usize {
        let c = &self.config;
        let value = match self.kv_dtype {
            FloatDType::F16 | FloatDType::BF16 => 2,
            FloatDType::F64 => 8,
            _ => 4,
        };
        self.num_layers() * 2 * c.kv_dim() * positions * value
    }

    /// Bytes a decode step reads with `ctx` positions cached: every layer's projections, the
    /// head (the embedding is a row gather) and the whole K/V cache.
    pub fn decode_read_bytes(&self, ctx: usize) -> usize {
        self.layer_weight_bytes() + self.lm_head.resident_bytes() + self.kv_bytes(ctx + 1)
    }

    /// Bytes of every layer's projections.
    fn layer_weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(Block::projections)
            .map(Weight::resident_bytes)
            .sum()
    }

    /// Fewest prompt rows a prefill after a reused cache prefix must run so that every matmul
    /// and the attention take the path a cold prefill's rows take: on the CPU kernels
    /// [`REUSE_FLOOR_ROWS`] (from there prompt rows take a long prompt's matmul path at any count,
    /// [`Rows::Prompt`](crate::weight::Rows)); for the GPU's packed weights [`REUSE_MIN_ROWS`].
    pub fn reuse_min_rows(&self) -> usize {
        let packed = self
            .layers
            .iter()
            .flat_map(Block::projections)
            .any(|w| matches!(w, Weight::Packed(_)));
        if !self.cpu_kernels() || packed {
            return REUSE_MIN_ROWS;
        }
        REUSE_FLOOR_ROWS
    }

    /// The instruction-set level the quantised CPU kernels run at (`RIDGEFILL_SIMD` can lower
    /// it), or `None` when no projection is held in GGUF blocks.
    pub fn kernel_level(&self) -> Option<&'static str> {
        let blocks = self
            .layers
            .iter()
            .flat_map(Block::projections)
            .any(|w| matches!(w, Weight::Blocks(_)));
        blocks.then(|| SimdLevel::detect().name())
    }

    /// How the projections are held, for reports: `blocks (Q4_1, Q8_0)` (CPU kernels),
    /// `packed (Q4_1, Q8_0)` (GPU kernel) or `dense f32`.
    pub fn weights_held(&self) -> String {
        let mut kinds: Vec<&'static str> = Vec::new();
        let all = self
            .layers
            .iter()
            .flat_map(Block::projections)
            .chain([&self.lm_head]);
        let (mut dense, mut packed) = (false, false);
        for w in all {
            let names: Vec<&'static str> = match w {
                Weight::Blocks(q) => q.parts().iter().map(|p| p.ty().name()).collect(),
                Weight::Packed(p) => {
                    packed = true;
                    p.formats.clone()
                }
                Weight::Dense(_) => {
                    dense = true;
                    Vec::new()
                }
            };
            for n in names {
                if !kinds.contains(&n) {
                    kinds.push(n);
                }
            }
        }
        let how = if packed { "packed" } else { "blocks" };
        match (kinds.is_empty(), dense) {
            (true, _) => format!("dense {}", crate::dtype_name(self.dtype)),
            (false, false) => format!("{how} ({})", kinds.join(", ")),
            (false, true) => format!("{how} ({}) and dense", kinds.join(", ")),
        }
    }

    /// Bytes the weights keep resident (block weights: their share of the mapped file; a tied
    /// head that reads the embedding's blocks is counted once).
    pub fn weight_bytes(&self) -> usize {
        let mut total = self.layer_weight_bytes() + self.embed_tokens.resident_bytes();
        let shared = match (&self.embed_tokens, &self.lm_head) {
            (Weight::Blocks(a), Weight::Blocks(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if !shared {
            total += self.lm_head.resident_bytes();
        }
        total
    }
}
