//! The decoder: one implementation for every supported family (Llama 2/3, SmolLM/SmolLM2,
//! TinyLlama, Mistral, Qwen2/2.5, Qwen3, Gemma 3), their differences data on [`ModelConfig`]
//! and optional per-block tensors: q/k/v biases, per-head q/k RMSNorm, norms after attention and
//! after the MLP (Gemma's sandwich), the MLP activation, embedding scale, attention scale and
//! soft-caps, and per-layer attention windows and RoPE bases.
//!
//! Read it in this order: [`load`] (checkpoint → [`Decoder`]), [`forward`] (the entry points:
//! prefill, decode, batches, scoring — one block top to bottom in [`Decoder::block`]),
//! [`attention`] and [`mlp`] (the two halves of a block), [`rope`] (tables and divisors),
//! [`report`] (sizes for benchmarks). Skip-and-fill lives apart, in [`crate::fill`].
//!
//! Projection fields are named after the Hugging Face tensor keys and stored transposed
//! (`[in, out]`) so every projection is a plain `x · W`; norms are named by where they sit in
//! the block, since HF's `post_attention_layernorm` is the pre-MLP norm in Llama and the norm of
//! the attention output in Gemma 3. Norm weights are stored as applied (Gemma's `1 +` is added
//! on load).

pub mod attention;
pub mod forward;
pub mod load;
pub mod mlp;
pub mod report;
pub mod rope;

use burn::tensor::{Device, FloatDType, Tensor};
use ridgefill_io::config::{Activation, Family, ModelConfig};

use crate::cache::KvCache;
use crate::error::Result;
use crate::rope::Rope;
use crate::weight::{Rows, Weight};

pub use attention::At;
pub use load::LoadOptions;

/// Prompt rows [`Decoder::prefill`] runs through the layers at a time: bounds the activations
/// (the MLP's `[rows, 2·intermediate]`) while the GEMMs stay large enough to run at full speed.
pub const PREFILL_CHUNK: usize = 256;

/// Fewest prompt rows a prefill after a reused cache prefix runs where the kernels' paths are
/// not known (the GPU's packed weights; [`Decoder::reuse_min_rows`]): the quantised matmuls
/// of the CPU took their 8-bit-activation path below 16–48 rows (by block type and CPU), whose
/// rounding moved SmolLM2's last-row logits by 0.69 and flipped a greedy answer, so the prompt's
/// last rows run as a cold prefill runs them.
pub const REUSE_MIN_ROWS: usize = 64;

pub use crate::weight::REUSE_FLOOR_ROWS;

/// How a block's attention and MLP run, chosen once per block when the model is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecPath {
    /// RidgeFill's fused flex kernels ([`crate::cpu`]): full causal attention at
    /// `head_dim^-1/2` without soft-cap, SwiGLU, norms before attention and before the MLP only.
    Fused,
    /// Plain burn ops: any device, every family feature.
    Generic,
}

impl ExecPath {
    /// The fused path where the CPU kernels run and the block has none of the features they lack.
    fn choose(cpu_kernels: bool, config: &ModelConfig, block: &Block) -> Self {
        let plain = block.window.is_none()
            && block.o_bias.is_none()
            && block.post_attn_norm.is_none()
            && block.post_mlp_norm.is_none()
            && config.hidden_act == Activation::Silu
            && config.query_pre_attn_scalar.is_none()
            && config.attn_logit_softcapping.is_none();
        match cpu_kernels && plain {
            true => Self::Fused,
            false => Self::Generic,
        }
    }
}

/// One decoder block.
pub struct Block {
    /// Before attention (HF `input_layernorm`).
    pub pre_attn_norm: Tensor<1>,
    /// HF `q_proj`, `k_proj`, `v_proj` side by side, `[hidden, q_dim + 2·kv_dim]`: one GEMM.
    pub qkv_proj: Weight,
    /// Their biases side by side, `[q_dim + 2·kv_dim]` (Qwen2; zeros for a missing part).
    pub qkv_bias: Option<Tensor<1>>,
    /// Per-head RMSNorm weights of Q and K, `[head_dim]` (Qwen3, Gemma 3).
    pub q_norm: Option<Tensor<1>>,
    pub k_norm: Option<Tensor<1>>,
    pub o_proj: Weight,
    /// `[hidden]`, when the checkpoint has one.
    pub o_bias: Option<Tensor<1>>,
    /// Of the attention output, before the residual add (Gemma 3's HF `post_attention_layernorm`).
    pub post_attn_norm: Option<Tensor<1>>,
    /// Before the MLP (Llama's HF `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`).
    pub pre_mlp_norm: Tensor<1>,
    /// Of the MLP output, before the residual add (Gemma 3's HF `post_feedforward_layernorm`).
    pub post_mlp_norm: Option<Tensor<1>>,
    /// HF `gate_proj` and `up_proj` side by side, `[hidden, 2·intermediate]`: one GEMM.
    pub gate_up_proj: Weight,
    pub down_proj: Weight,
    /// Keys a query sees (itself included) on a sliding-window layer; `None` for full attention.
    pub window: Option<usize>,
    /// Rotates with [`Decoder::rope_local`] (Gemma 3's sliding layers) instead of [`Decoder::rope`].
    pub local_rope: bool,
    /// Set by [`Decoder::set_cpu_kernels`] (and when the model is built).
    pub(crate) path: ExecPath,
}

impl Block {
    /// How this block runs.
    pub fn path(&self) -> ExecPath {
        self.path
    }
}

/// A decoder-only transformer's weights on one device (caches live outside, in [`KvCache`]).
pub struct Decoder {
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed_tokens: Weight,
    pub layers: Vec<Block>,
    pub norm: Tensor<1>,
    /// Output head, transposed: `[hidden, vocab]` (the embedding's blocks themselves, or a
    /// dense copy, when tied).
    pub lm_head: Weight,
    /// RoPE of full-attention layers (and of every layer without a local base).
    pub rope: Rope,
    /// RoPE of sliding-window layers with their own base (Gemma 3), without `rope_scaling`.
    pub rope_local: Option<Rope>,
    pub device: Device,
    pub dtype: FloatDType,
    /// Whether norms, RoPE, attention and SwiGLU may run through the fused flex kernels; see
    /// [`Decoder::set_cpu_kernels`].
    cpu_kernels: bool,
    /// What the KV cache stores: the activations' dtype, or f16 on the fused CPU path when
    /// [`crate::cpu::KV_SWITCH`] asks for it. See [`kv_dtype`].
    pub kv_dtype: FloatDType,
}

/// The parts a [`Decoder`] is built from (by [`Decoder::load`] or the synthetic constructors).
pub(crate) struct Parts {
    pub config: ModelConfig,
    pub embed_tokens: Weight,
    pub layers: Vec<Block>,
    pub norm: Tensor<1>,
    pub lm_head: Weight,
    pub divisors: Option<Vec<f64>>,
    pub max_positions: usize,
}

/// Architectures the decoder implements (HF `model_type`), as [`Family::of_model_type`] knows them.
pub fn supports(model_type: &str) -> bool {
    Family::of_model_type(model_type).is_some()
}

/// The KV cache's storage dtype for activations of `dtype`: where the fused CPU kernels run,
/// what [`crate::cpu::KV_SWITCH`] says (f32 unless set to f16); elsewhere `dtype` itself.
pub fn kv_dtype(cpu_kernels: bool, dtype: FloatDType) -> Result<FloatDType> {
    #[cfg(feature = "flex")]
    if cpu_kernels {
        return crate::cpu::kv_storage();
    }
    let _ = cpu_kernels;
    Ok(dtype)
}

/// Whether the fused flex kernels can run on `device` at `dtype` (an error for a bad switch).
pub fn cpu_kernels_apply(device: &Device, dtype: FloatDType) -> Result<bool> {
    #[cfg(feature = "flex")]
    return crate::cpu::enabled(device, dtype);
    #[cfg(not(feature = "flex"))]
    {
        let _ = (device, dtype);
        Ok(false)
    }
}

impl Decoder {
    /// Assembles a model on `device` at `dtype`: RoPE tables, KV storage, each block's path.
    pub(crate) fn assemble(parts: Parts, device: &Device, dtype: FloatDType) -> Result<Self> {
        let cpu_kernels = cpu_kernels_apply(device, dtype)?;
        let (rope, rope_local) = rope::ropes(
            &parts.config,
            parts.divisors.as_deref(),
            parts.max_positions.max(1),
            dtype,
            device,
        );
        let mut model = Self {
            config: parts.config,
            embed_tokens: parts.embed_tokens,
            layers: parts.layers,
            norm: parts.norm,
            lm_head: parts.lm_head,
            rope,
            rope_local,
            device: device.clone(),
            dtype,
            cpu_kernels,
            kv_dtype: kv_dtype(cpu_kernels, dtype)?,
        };
        model.set_cpu_kernels(cpu_kernels);
        Ok(model)
    }

    /// Whether the fused flex kernels run where a block allows them (on by default where they
    /// apply: flex, f32).
    pub fn cpu_kernels(&self) -> bool {
        self.cpu_kernels
    }

    /// Turns the fused flex kernels on or off (off compares them against the plain burn ops)
    /// and chooses each block's [`ExecPath`] again.
    pub fn set_cpu_kernels(&mut self, on: bool) {
        self.cpu_kernels = on;
        for block in &mut self.layers {
            block.path = ExecPath::choose(on, &self.config, block);
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// A cache sized for `capacity` positions (at most the RoPE table's length).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let cap = capacity.min(self.rope.max_positions());
        KvCache::with_storage(
            self.num_layers(),
            self.config.num_key_value_heads,
            self.config.head_dim(),
            cap,
            self.dtype,
            self.kv_dtype,
            &self.device,
        )
    }

    /// Whether layer `l` runs the fused CPU kernels ([`ExecPath::Fused`]).
    pub fn fused_block(&self, l: usize) -> bool {
        self.layers[l].path == ExecPath::Fused
    }

    /// `x · w` by the weight's own kernel (see [`Weight::matmul`]).
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]` → `[m, n]`
    pub fn linear(&self, x: Tensor<2>, w: &Weight, rows: Rows) -> Tensor<2> {
        w.matmul(x, rows, self.cpu_kernels)
    }

    /// [`Decoder::linear`] added to a residual stream.
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
    pub fn linear_add(
        &self,
        x: Tensor<2>,
        w: &Weight,
        residual: Tensor<2>,
        rows: Rows,
    ) -> Tensor<2> {
        w.matmul_add(x, residual, rows, self.cpu_kernels)
    }

    /// [`Decoder::linear`] over a dense `[k, n]` tensor (fill maps, dense weights).
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]` → `[m, n]`
    pub fn linear_dense(&self, x: Tensor<2>, w: &Tensor<2>) -> Tensor<2> {
        crate::weight::dense_matmul(x, w, None, self.cpu_kernels)
    }

    /// [`Decoder::linear_dense`] added to `residual`.
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
    pub fn linear_dense_add(&self, x: Tensor<2>, w: &Tensor<2>, residual: Tensor<2>) -> Tensor<2> {
        crate::weight::dense_matmul(x, w, Some(residual), self.cpu_kernels)
    }
}
