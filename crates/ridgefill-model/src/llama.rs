//! The decoder: one implementation for every supported family (Llama 2/3, SmolLM/SmolLM2,
//! TinyLlama, Mistral, Qwen2/2.5, Qwen3, Gemma 3), their differences data on [`ModelConfig`]
//! and optional per-layer tensors: q/k/v biases, per-head q/k RMSNorm, Gemma's sandwich norms,
//! the MLP activation, embedding scale, attention scale and soft-caps, and per-layer attention
//! windows and RoPE bases. The type keeps its historical name, `Llama`.
//!
//! Fields are named after the Hugging Face tensor keys; projection weights are stored transposed
//! (`[in, out]`) so every projection is a plain `x · W`. Norm weights are stored as applied (for
//! Gemma's `(1 + w)` norms the `1 +` is added on load).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, FloatDType, Int, Tensor, TensorData, activation};
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::config::{Activation, ModelConfig};
use ridgefill_quant::{QMatrix, QWeight, SimdLevel, WeightBytes};

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::rope::Rope;
use crate::weight::{Weight, WeightFormat};

/// Where a block's rows sit in the sequence.
#[derive(Clone, Copy, Debug)]
pub enum At<'a> {
    /// Consecutive positions from this one on, appended after the layer's cached slots.
    Next(usize),
    /// Row `i` at position `at[i]` (increasing); the layer already holds a slot for every
    /// position up to the last (slot = position), and these rows overwrite theirs.
    Rows(&'a [usize]),
}

/// Writes rows' rotated K and V into `layer`'s cache as `at` says; returns how many keys each
/// row sees (empty for [`At::Next`], whose rows see everything before them in order).
fn store(cache: &mut KvCache, layer: usize, k: Tensor<4>, v: Tensor<4>, at: At) -> Vec<usize> {
    match at {
        At::Next(_) => {
            cache.append(layer, k, v);
            Vec::new()
        }
        At::Rows(p) => {
            let mut i0 = 0;
            while i0 < p.len() {
                // One slice write per run of consecutive positions.
                let mut i1 = i0 + 1;
                while i1 < p.len() && p[i1] == p[i1 - 1] + 1 {
                    i1 += 1;
                }
                let (kr, vr) = (
                    k.clone().narrow(2, i0, i1 - i0),
                    v.clone().narrow(2, i0, i1 - i0),
                );
                cache.overwrite(layer, p[i0], kr, vr);
                i0 = i1;
            }
            p.iter().map(|&x| x + 1).collect()
        }
    }
}

/// Architectures this file implements (HF `model_type`).
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3_text"];

/// One decoder block.
pub struct LlamaLayer {
    pub input_layernorm: Tensor<1>,
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
    /// Llama: the pre-MLP norm. With sandwich norms (Gemma 3): the norm of the attention output.
    pub post_attention_layernorm: Tensor<1>,
    /// Sandwich norms only: before and after the MLP.
    pub pre_feedforward_layernorm: Option<Tensor<1>>,
    pub post_feedforward_layernorm: Option<Tensor<1>>,
    /// HF `gate_proj` and `up_proj` side by side, `[hidden, 2·intermediate]`: one GEMM.
    pub gate_up_proj: Weight,
    pub down_proj: Weight,
    /// Keys a query sees (itself included) on a sliding-window layer; `None` for full attention.
    pub window: Option<usize>,
    /// Rotates with [`Llama::rope_local`] (Gemma 3's sliding layers) instead of [`Llama::rope`].
    pub local_rope: bool,
}

pub struct Llama {
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed_tokens: Weight,
    pub layers: Vec<LlamaLayer>,
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
    /// Run norms, RoPE, attention and SwiGLU through the fused flex kernels ([`crate::cpu`]); on
    /// by default where they apply (flex, f32), off to compare against the plain burn ops.
    /// Blocks with features the fused attention and MLP lack run the plain ops regardless
    /// ([`Llama::fused_block`]).
    pub cpu_kernels: bool,
    /// What the KV cache stores: the activations' dtype, or f16 on the fused CPU path when
    /// [`crate::cpu::KV_SWITCH`] asks for it. See [`kv_dtype`].
    pub kv_dtype: FloatDType,
}

/// Options for loading a model onto a device.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub dtype: FloatDType,
    /// Positions the RoPE tables cover (the context the caller intends to use).
    pub max_positions: usize,
    /// How GGUF weights are held.
    pub weights: WeightFormat,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: FloatDType::F32,
            max_positions: 4096,
            weights: WeightFormat::default(),
        }
    }
}

struct Loader<'a> {
    ckpt: &'a Checkpoint,
    device: &'a Device,
    dtype: FloatDType,
    /// Projections are held quantised in this format (`None`: dense tensors).
    blocks: Option<WeightFormat>,
    /// Blocks run on the flex CPU kernels (else they are packed for a GPU).
    flex: bool,
}

impl Loader<'_> {
    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let data = self.ckpt.tensor_f32(name)?;
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(ModelError::TensorSize {
                path: self.ckpt.path.clone(),
                tensor: name.to_string(),
                expected,
                found: data.len(),
                shape: shape.to_vec(),
            });
        }
        if let Some(index) = data.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite {
                path: self.ckpt.path.clone(),
                tensor: name.to_string(),
                index,
            });
        }
        Ok(data)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Tensor<1>> {
        let data = self.host(name, &[len])?;
        Ok(self.upload(data))
    }

    fn upload(&self, data: Vec<f32>) -> Tensor<1> {
        let len = data.len();
        Tensor::<1>::from_data(TensorData::new(data, [len]), self.device).cast(self.dtype)
    }

    /// A norm weight as applied: the stored weight plus the config's offset (Gemma's `1 + w`).
    fn norm(&self, name: &str, len: usize) -> Result<Tensor<1>> {
        let offset = self.ckpt.config.norm_weight_offset as f32;
        let mut data = self.host(name, &[len])?;
        if offset != 0.0 {
            data.iter_mut().for_each(|x| *x += offset);
        }
        Ok(self.upload(data))
    }

    /// [`Loader::norm`] when the checkpoint has the tensor.
    fn opt_norm(&self, name: &str, len: usize) -> Result<Option<Tensor<1>>> {
        if self.ckpt.has_tensor(name) {
            self.norm(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Biases of consecutive output parts side by side (zeros for a part without one), or
    /// `None` when no part has one.
    fn fused_bias(&self, parts: &[(String, usize)]) -> Result<Option<Tensor<1>>> {
        if !parts.iter().any(|(n, _)| self.ckpt.has_tensor(n)) {
            return Ok(None);
        }
        let mut data = Vec::new();
        for (name, len) in parts {
            if self.ckpt.has_tensor(name) {
                data.extend(self.host(name, &[*len])?);
            } else {
                data.extend(std::iter::repeat_n(0.0, *len));
            }
        }
        Ok(Some(self.upload(data)))
    }

    /// Loads an HF `[out, in]` weight and stores it as `[in, out]`.
    fn linear_t(&self, name: &str, out: usize, inp: usize) -> Result<Tensor<2>> {
        self.fused_t(&[(name.to_string(), out)], inp)
    }

    /// Loads HF `[out_i, in]` weights and stores them side by side as `[in, Σ out_i]`.
    fn fused_t(&self, parts: &[(String, usize)], inp: usize) -> Result<Tensor<2>> {
        let mut rows = Vec::new();
        let mut total = 0;
        for (name, out) in parts {
            rows.extend(self.host(name, &[*out, inp])?);
            total += out;
        }
        Ok(transposed(&rows, total, inp, self.device).cast(self.dtype))
    }

    /// A projection from HF `[out_i, in]` weights side by side: blocks for the CPU kernels where
    /// the format allows, else a dense `[in, Σ out_i]` tensor.
    fn proj(&self, parts: &[(String, usize)], inp: usize) -> Result<Weight> {
        match self.blocks_of(parts, inp)? {
            Some(q) => match Weight::from_blocks(Arc::new(q), self.device) {
                Some(w) => Ok(w),
                None => Ok(Weight::Dense(self.fused_t(parts, inp)?)),
            },
            None => Ok(Weight::Dense(self.fused_t(parts, inp)?)),
        }
    }

    /// HF `[out_i, in]` weights stacked along their output rows as blocks, or `None` where the
    /// format keeps them dense (a Hugging Face checkpoint at `native`, a type without a kernel).
    fn blocks_of(&self, parts: &[(String, usize)], inp: usize) -> Result<Option<QWeight>> {
        let Some(format) = self.blocks else {
            return Ok(None);
        };
        let mut mats = Vec::with_capacity(parts.len());
        for (name, out) in parts {
            let bad = |e: ridgefill_quant::QError| {
                ModelError::Invalid(format!("{}: tensor {name}: {e}", self.ckpt.path.display()))
            };
            let m = match format {
                WeightFormat::Native => {
                    let Some(st) = self.ckpt.tensor_stored(name)? else {
                        return Ok(None);
                    };
                    if st.shape != [*out, inp] {
                        return Err(ModelError::TensorSize {
                            path: self.ckpt.path.clone(),
                            tensor: name.to_string(),
                            expected: out * inp,
                            found: st.shape.iter().product(),
                            shape: vec![*out, inp],
                        });
                    }
                    let mapped = st.bytes.clone();
                    let bytes = WeightBytes::from_owner(Arc::new(st.bytes), |b| &b[..]);
                    let m = match QMatrix::new(st.ty, *out, inp, bytes) {
                        Err(ridgefill_quant::QError::Unsupported(_)) => return Ok(None),
                        m => m.map_err(bad)?,
                    };
                    self.check_finite(name, &m)?;
                    if !self.flex {
                        // Packed for the GPU from the layout as stored.
                        mats.push(m);
                        continue;
                    }
                    let m = m.prepared_for(SimdLevel::detect());
                    if m.is_row_lanes() {
                        // Rearranged into a copy: the mapped original need not stay resident.
                        mapped.evict();
                    }
                    m
                }
                // f32 stays dense; f16 and q8 are converted here.
                format => {
                    let Some(ty) = format.load_type() else {
                        return Ok(None);
                    };
                    let data = self.host(name, &[*out, inp])?;
                    // Rows that do not fill whole blocks stay dense.
                    let Some(bytes) = ridgefill_io::quant::quantize(ty, &data)
                        .filter(|_| inp.is_multiple_of(ty.block_size()))
                    else {
                        return Ok(None);
                    };
                    let m =
                        QMatrix::new(ty, *out, inp, WeightBytes::from_vec(bytes)).map_err(bad)?;
                    match self.flex {
                        true => m.prepared_for(SimdLevel::detect()),
                        false => m,
                    }
                }
            };
            mats.push(m);
        }
        QWeight::new(mats)
            .map(Some)
            .map_err(|e| ModelError::Invalid(format!("{}: {e}", self.ckpt.path.display())))
    }

    /// Blocks as stored are never dequantised at load, so a NaN or infinity in them (a bad scale
    /// or value) is looked for here, a few rows at a time, as the dense path looks for it.
    fn check_finite(&self, name: &str, m: &QMatrix) -> Result<()> {
        const ROWS: usize = 64;
        let cols = m.cols();
        let mut buf = vec![0f32; ROWS.min(m.rows()) * cols];
        for r0 in (0..m.rows()).step_by(ROWS) {
            let chunk = &mut buf[..ROWS.min(m.rows() - r0) * cols];
            m.dequantize_rows_into(r0, chunk).map_err(|e| {
                ModelError::Invalid(format!("{}: tensor {name}: {e}", self.ckpt.path.display()))
            })?;
            if let Some(i) = chunk.iter().position(|x| !x.is_finite()) {
                return Err(ridgefill_io::IoError::NonFinite {
                    path: self.ckpt.path.clone(),
                    tensor: name.to_string(),
                    index: r0 * cols + i,
                    value: f64::from(chunk[i]),
                }
                .into());
            }
        }
        Ok(())
    }

    /// The embedding `[vocab, hidden]`: blocks where the format allows, else dense.
    fn embedding(&self, name: &str, vocab: usize, d: usize) -> Result<Weight> {
        match self.blocks_of(&[(name.to_string(), vocab)], d)? {
            Some(q) => Ok(Weight::Blocks(Arc::new(q))),
            None => Ok(Weight::Dense(self.matrix(name, vocab, d)?)),
        }
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<2>> {
        let data = self.host(name, &[rows, cols])?;
        Ok(
            Tensor::<2>::from_data(TensorData::new(data, [rows, cols]), self.device)
                .cast(self.dtype),
        )
    }
}

/// GGUF name of llama.cpp's per-frequency RoPE divisors, as the checkpoint exposes it.
/// Prompt rows [`Llama::prefill`] runs through the layers at a time: bounds the activations
/// (the MLP's `[rows, 2·intermediate]`) while the GEMMs stay large enough to run at full speed.
pub const PREFILL_CHUNK: usize = 256;

const GGUF_ROPE_FREQS: &str = "gguf.rope_freqs.weight";

/// Long-context RoPE divisors: Llama 3 scaling from the config, or a GGUF `rope_freqs` tensor.
fn rope_divisors(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Option<Vec<f64>>> {
    let Some(sc) = cfg.rope_scaling.as_ref() else {
        return Ok(None);
    };
    match sc.kind() {
        Some("llama3") => Ok(Some(ridgefill_io::config::llama3_rope_divisors(
            sc,
            cfg.rope_theta,
            cfg.head_dim(),
        ))),
        Some("gguf_rope_freqs") => {
            let d = ckpt.tensor_f32(GGUF_ROPE_FREQS)?;
            Ok(Some(d.into_iter().map(f64::from).collect()))
        }
        Some("linear") => {
            let f = sc.factor.unwrap_or(1.0);
            Ok(Some(vec![f; cfg.head_dim() / 2]))
        }
        Some("default") | None => Ok(None),
        Some(other) => Err(ModelError::Invalid(format!(
            "{}: unsupported rope_scaling type {other:?} (supported: llama3, linear)",
            ckpt.path.display()
        ))),
    }
}

/// The model's RoPE tables: the global one (with `divisors`), and the local one of sliding
/// layers when the config gives them their own base.
pub(crate) fn ropes(
    cfg: &ModelConfig,
    divisors: Option<&[f64]>,
    max_positions: usize,
    dtype: FloatDType,
    device: &Device,
) -> (Rope, Option<Rope>) {
    let hd = cfg.head_dim();
    let rope = Rope::new(hd, cfg.rope_theta, divisors, max_positions, dtype, device);
    let local = (0..cfg.num_hidden_layers)
        .any(|l| cfg.layer_uses_local_rope(l))
        .then(|| {
            let theta = cfg.rope_local_base_freq.unwrap_or(cfg.rope_theta);
            Rope::new(hd, theta, None, max_positions, dtype, device)
        });
    (rope, local)
}

/// `x · Wᵀ` (plus `residual`) through the quantised CPU kernels; block weights are only loaded
/// for flex.
///
/// # Shapes
/// - x: `[m, k]`, w: `[n, k]` blocks, residual: `[m, n]` → `[m, n]`
fn block_matmul(x: Tensor<2>, w: &QWeight, residual: Option<Tensor<2>>) -> Tensor<2> {
    #[cfg(feature = "flex")]
    return crate::cpu::qmatmul(x, w, residual);
    #[cfg(not(feature = "flex"))]
    {
        let _ = (x, w, residual);
        unreachable!("block weights are loaded only for the flex device")
    }
}

/// Host-side transpose of a row-major `[rows, cols]` matrix into a `[cols, rows]` tensor.
fn transposed(data: &[f32], rows: usize, cols: usize, device: &Device) -> Tensor<2> {
    let mut t = vec![0.0f32; data.len()];
    for (r, row) in data.chunks_exact(cols).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            t[c * rows + r] = x;
        }
    }
    Tensor::from_data(TensorData::new(t, [cols, rows]), device)
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

impl Llama {
    /// Loads every weight of `ckpt` onto `device`, checking names, sizes and finiteness.
    pub fn load(ckpt: &Checkpoint, device: &Device, opts: &LoadOptions) -> Result<Self> {
        // Checked first: a bad switch should not cost a whole load.
        let cpu_kernels = cpu_kernels_apply(device, opts.dtype)?;
        let kv_dtype = kv_dtype(cpu_kernels, opts.dtype)?;
        let cfg = ckpt.config.clone();
        if !SUPPORTED_MODEL_TYPES.contains(&cfg.model_type.as_str()) {
            return Err(ModelError::UnsupportedArchitecture {
                path: ckpt.path.clone(),
                found: cfg.model_type.clone(),
            });
        }
        cfg.validate(&ckpt.path)?;
        // The CPU kernels run on the host with f32 activations; GPUs pack Q4_0 … Q6_K and Q8_0
        // made at load (F16 weights stay dense there).
        let flex = crate::device::is_flex(device);
        let blocks = match flex {
            true => opts.weights != WeightFormat::F32 && opts.dtype == FloatDType::F32,
            false => matches!(opts.weights, WeightFormat::Native | WeightFormat::Q8),
        }
        .then_some(opts.weights);
        let ld = Loader {
            ckpt,
            device,
            dtype: opts.dtype,
            blocks,
            flex,
        };
        let d = cfg.hidden_size;
        let q_dim = cfg.num_attention_heads * cfg.head_dim();
        let kv_dim = cfg.kv_dim();
        let ff = cfg.intermediate_size;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let hd = cfg.head_dim();
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = |part: &str, what: &str| format!("{p}.self_attn.{part}.{what}");
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(ld.norm(&attn("q_norm", "weight"), hd)?),
                    Some(ld.norm(&attn("k_norm", "weight"), hd)?),
                )
            } else {
                (None, None)
            };
            let (pre_ff, post_ff) = if cfg.sandwich_norms {
                (
                    Some(ld.norm(&format!("{p}.pre_feedforward_layernorm.weight"), d)?),
                    Some(ld.norm(&format!("{p}.post_feedforward_layernorm.weight"), d)?),
                )
            } else {
                (
                    ld.opt_norm(&format!("{p}.pre_feedforward_layernorm.weight"), d)?,
                    ld.opt_norm(&format!("{p}.post_feedforward_layernorm.weight"), d)?,
                )
            };
            let o_bias_name = attn("o_proj", "bias");
            layers.push(LlamaLayer {
                input_layernorm: ld.norm(&format!("{p}.input_layernorm.weight"), d)?,
                qkv_proj: ld.proj(
                    &[
                        (attn("q_proj", "weight"), q_dim),
                        (attn("k_proj", "weight"), kv_dim),
                        (attn("v_proj", "weight"), kv_dim),
                    ],
                    d,
                )?,
                qkv_bias: ld.fused_bias(&[
                    (attn("q_proj", "bias"), q_dim),
                    (attn("k_proj", "bias"), kv_dim),
                    (attn("v_proj", "bias"), kv_dim),
                ])?,
                q_norm,
                k_norm,
                o_proj: ld.proj(&[(attn("o_proj", "weight"), d)], q_dim)?,
                o_bias: if ckpt.has_tensor(&o_bias_name) {
                    Some(ld.vector(&o_bias_name, d)?)
                } else {
                    None
                },
                post_attention_layernorm: ld
                    .norm(&format!("{p}.post_attention_layernorm.weight"), d)?,
                pre_feedforward_layernorm: pre_ff,
                post_feedforward_layernorm: post_ff,
                gate_up_proj: ld.proj(
                    &[
                        (format!("{p}.mlp.gate_proj.weight"), ff),
                        (format!("{p}.mlp.up_proj.weight"), ff),
                    ],
                    d,
                )?,
                down_proj: ld.proj(&[(format!("{p}.mlp.down_proj.weight"), d)], ff)?,
                window: cfg.layer_window(i),
                local_rope: cfg.layer_uses_local_rope(i),
            });
        }
        let embed_name = "model.embed_tokens.weight";
        let embed_tokens = ld.embedding(embed_name, cfg.vocab_size, d)?;
        let tied = cfg.tie_word_embeddings || !ckpt.has_tensor("lm_head.weight");
        let lm_head = match (&embed_tokens, tied) {
            // The tied head reads the embedding's own blocks: no second copy on the CPU.
            (Weight::Blocks(q), true) => match Weight::from_blocks(q.clone(), device) {
                Some(w) => w,
                None => Weight::Dense(ld.linear_t(embed_name, cfg.vocab_size, d)?),
            },
            (_, true) => Weight::Dense(ld.linear_t(embed_name, cfg.vocab_size, d)?),
            (_, false) => ld.proj(&[("lm_head.weight".to_string(), cfg.vocab_size)], d)?,
        };
        let norm = ld.norm("model.norm.weight", d)?;
        let divisors = rope_divisors(ckpt, &cfg)?;
        let (rope, rope_local) = ropes(
            &cfg,
            divisors.as_deref(),
            opts.max_positions,
            opts.dtype,
            device,
        );
        Ok(Self {
            config: cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            rope_local,
            device: device.clone(),
            dtype: opts.dtype,
            cpu_kernels,
            kv_dtype,
        })
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

    /// The RoPE tables layer `l` rotates with.
    pub fn rope_of(&self, l: usize) -> &Rope {
        match (&self.rope_local, self.layers[l].local_rope) {
            (Some(r), true) => r,
            _ => &self.rope,
        }
    }

    /// Whether layer `l`'s attention and MLP run through the fused flex kernels: they implement
    /// full causal attention at `head_dim^-1/2` without soft-cap, SwiGLU and the Llama norm
    /// placement; other blocks take the plain burn ops.
    pub fn fused_block(&self, l: usize) -> bool {
        let layer = &self.layers[l];
        let c = &self.config;
        self.cpu_kernels
            && layer.window.is_none()
            && layer.o_bias.is_none()
            && layer.pre_feedforward_layernorm.is_none()
            && layer.post_feedforward_layernorm.is_none()
            && !c.sandwich_norms
            && c.hidden_act == Activation::Silu
            && c.query_pre_attn_scalar.is_none()
            && c.attn_logit_softcapping.is_none()
    }

    /// `x · w` through the flex GEMM without burn-flex's extra output passes where the fused
    /// kernels apply, else burn's matmul.
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]` → `[m, n]`
    pub fn linear(&self, x: Tensor<2>, w: &Weight) -> Tensor<2> {
        match w {
            Weight::Dense(w) => self.linear_dense(x, w),
            Weight::Blocks(q) => block_matmul(x, q, None),
            Weight::Packed(p) => p.matmul(x),
        }
    }

    /// [`Llama::linear`] added to a residual stream.
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
    pub fn linear_add(&self, x: Tensor<2>, w: &Weight, residual: Tensor<2>) -> Tensor<2> {
        match w {
            Weight::Dense(w) => self.linear_dense_add(x, w, residual),
            Weight::Blocks(q) => block_matmul(x, q, Some(residual)),
            Weight::Packed(p) => residual + p.matmul(x),
        }
    }

    /// [`Llama::linear`] over a dense `[k, n]` tensor (fill maps, dense weights).
    pub fn linear_dense(&self, x: Tensor<2>, w: &Tensor<2>) -> Tensor<2> {
        #[cfg(feature = "flex")]
        if self.cpu_kernels && w.dtype() == x.dtype() {
            return crate::cpu::matmul(x, w);
        }
        x.matmul(w.clone())
    }

    /// [`Llama::linear_dense`] added to `residual`.
    ///
    /// # Shapes
    /// - x: `[m, k]`, w: `[k, n]`, residual: `[m, n]` → `[m, n]`
    pub fn linear_dense_add(&self, x: Tensor<2>, w: &Tensor<2>, residual: Tensor<2>) -> Tensor<2> {
        #[cfg(feature = "flex")]
        if self.cpu_kernels && w.dtype() == x.dtype() {
            return crate::cpu::matmul_add(x, w, residual);
        }
        residual + x.matmul(w.clone())
    }

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
            .flat_map(|l| [&l.qkv_proj, &l.o_proj, &l.gate_up_proj, &l.down_proj])
            .map(Weight::resident_bytes)
            .sum()
    }

    /// The instruction-set level the quantised CPU kernels run at (`RIDGEFILL_SIMD` can lower
    /// it), or `None` when no projection is held in GGUF blocks.
    pub fn kernel_level(&self) -> Option<&'static str> {
        let blocks = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv_proj, &l.o_proj, &l.gate_up_proj, &l.down_proj])
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
            .flat_map(|l| [&l.qkv_proj, &l.o_proj, &l.gate_up_proj, &l.down_proj])
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

    /// [`Llama::forward_layers`] over `h`'s rows [`PREFILL_CHUNK`] at a time, each chunk through
    /// all of `layers` before the next (as causal attention allows): the prompt-length passes
    /// of skip-and-fill keep the same bounded activations as [`Llama::prefill`].
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, hidden]`
    pub fn forward_layers_chunked(
        &self,
        h: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
        pos: usize,
    ) -> Result<Tensor<2>> {
        let m = h.dims()[0];
        if m <= PREFILL_CHUNK {
            return self.forward_layers(h, layers, cache, pos);
        }
        let mut out = Vec::with_capacity(m.div_ceil(PREFILL_CHUNK));
        for c0 in (0..m).step_by(PREFILL_CHUNK) {
            let rows = h.clone().narrow(0, c0, PREFILL_CHUNK.min(m - c0));
            out.push(self.forward_layers(rows, layers.clone(), cache, pos + c0)?);
        }
        Ok(Tensor::cat(out, 0))
    }

    /// As [`Llama::forward_layers`], also returning each layer's pre-RoPE K and V (calibration
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

    fn run_layers(
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

    /// `[m, 2·kv_dim]` (K columns then V columns) → K and V as `[1, kv_heads, m, hd]`.
    fn split_kv(&self, kv: Tensor<2>) -> (Tensor<4>, Tensor<4>) {
        let (kvh, kv_dim) = (self.config.num_key_value_heads, self.config.kv_dim());
        let k = kv.clone().narrow(1, 0, kv_dim);
        let v = kv.narrow(1, kv_dim, kv_dim);
        (self.split_heads(k, kvh), self.split_heads(v, kvh))
    }

    /// `[m, heads*hd]` → `[1, heads, m, hd]`
    pub fn split_heads(&self, x: Tensor<2>, heads: usize) -> Tensor<4> {
        let m = x.dims()[0];
        x.reshape([1, m, heads, self.config.head_dim()])
            .swap_dims(1, 2)
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
        let qkv = self.qkv(l, h.clone());
        self.block_qkv(l, h, qkv, cache, at)
    }

    /// Layer `l`'s fused Q/K/V projection of its normed input (pre-RoPE).
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, q_dim + 2·kv_dim]`
    pub(crate) fn qkv(&self, l: usize, h: Tensor<2>) -> Tensor<2> {
        let layer = &self.layers[l];
        let x = self.rms_norm(h, Some(&layer.input_layernorm));
        let y = self.linear(x, &layer.qkv_proj);
        let y = match &layer.qkv_bias {
            Some(b) => y + b.clone().unsqueeze_dim::<2>(0),
            None => y,
        };
        let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) else {
            return y;
        };
        // Per-head RMSNorm of Q and K (pre-RoPE): the K the cache and the fill maps see.
        let c = &self.config;
        let (hd, q_dim, kv_dim) = (c.head_dim(), c.q_dim(), c.kv_dim());
        let m = y.dims()[0];
        let per_head = |x: Tensor<2>, w: &Tensor<1>, width: usize| {
            let heads = width / hd;
            self.rms_norm(x.reshape([m * heads, hd]), Some(w))
                .reshape([m, width])
        };
        let q = per_head(y.clone().narrow(1, 0, q_dim), qn, q_dim);
        let k = per_head(y.clone().narrow(1, q_dim, kv_dim), kn, kv_dim);
        let v = y.narrow(1, q_dim + kv_dim, kv_dim);
        Tensor::cat(vec![q, k, v], 1)
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
        (self.block_after_attention(l, h, attn), kv_pre)
    }

    /// The attention half of a block: RoPE, cache write and attention of the rows' Q/K/V; also
    /// returns their pre-RoPE K/V. Rows of one sequence; batched decode calls it per sequence.
    ///
    /// # Shapes
    /// - qkv: `[m, q_dim + 2·kv_dim]` → (`[m, q_dim]`, `[m, 2·kv_dim]`)
    fn attention_rows(
        &self,
        l: usize,
        qkv: Tensor<2>,
        cache: &mut KvCache,
        at: At,
    ) -> (Tensor<2>, Tensor<2>) {
        let layer = &self.layers[l];
        let cfg = &self.config;
        let m = qkv.dims()[0];
        let (heads, kv_heads, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let q_dim = heads * hd;
        let kv_pre = qkv.clone().narrow(1, q_dim, 2 * kv_heads * hd);
        let rope = self.rope_of(l);
        #[cfg(feature = "flex")]
        if self.fused_block(l) {
            let item = self.fused_attention_item(l, qkv, cache, at);
            return (crate::cpu::attention_many(vec![item]), kv_pre);
        }
        let rotate = |x: Tensor<4>| match at {
            At::Next(pos) => rope.apply(x, pos),
            At::Rows(p) => rope.apply_at(x, p),
        };
        let q = rotate(self.split_heads(qkv.narrow(1, 0, q_dim), heads));
        let (k, v) = self.split_kv(kv_pre.clone());
        let seen = store(cache, l, rotate(k), v, at);
        let (k_all, v_all) = cache.read(l);
        let attn = self.attend(q, k_all, v_all, heads, kv_heads, &seen, layer.window);
        (attn.swap_dims(1, 2).reshape([m, heads * hd]), kv_pre)
    }

    /// The fused CPU path's RoPE and cache write of one sequence's rows, and what its attention
    /// reads: the rows' queries and the layer's whole K/V.
    ///
    /// # Shapes
    /// - qkv: `[m, q_dim + 2·kv_dim]`
    #[cfg(feature = "flex")]
    fn fused_attention_item(
        &self,
        l: usize,
        qkv: Tensor<2>,
        cache: &mut KvCache,
        at: At,
    ) -> crate::cpu::AttnItem {
        let cfg = &self.config;
        let rope = self.rope_of(l);
        let rot = match at {
            At::Next(pos) => rope.host(pos),
            At::Rows(p) => rope.host_at(0, p),
        };
        let (q, k, v) =
            crate::cpu::qkv_rope(qkv, cfg.num_attention_heads, cfg.num_key_value_heads, rot);
        let (k, v) = match cache.stored_dtype() {
            FloatDType::F16 => (crate::cpu::narrow_kv(k), crate::cpu::narrow_kv(v)),
            _ => (k, v),
        };
        let seen = store(cache, l, k, v, at);
        let (k, v) = cache.read_stored(l);
        crate::cpu::AttnItem { q, k, v, seen }
    }

    /// The attention half of a block for several sequences' rows: the first `ns[0]` rows of
    /// `qkv` continue `caches[0]` at its next position, the next `ns[1]` rows `caches[1]`, and so
    /// on. On the fused CPU path the sequences' attention runs as one parallel job; elsewhere
    /// sequence by sequence.
    ///
    /// # Shapes
    /// - qkv: `[Σ ns, q_dim + 2·kv_dim]` → `[Σ ns, q_dim]`
    fn attention_batch(
        &self,
        l: usize,
        qkv: Tensor<2>,
        ns: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Tensor<2> {
        let offsets: Vec<usize> = ns
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        #[cfg(feature = "flex")]
        if self.fused_block(l) {
            let items = caches
                .iter_mut()
                .enumerate()
                .map(|(i, c)| {
                    let rows = qkv.clone().narrow(0, offsets[i], ns[i]);
                    let at = At::Next(c.len());
                    self.fused_attention_item(l, rows, c, at)
                })
                .collect();
            return crate::cpu::attention_many(items);
        }
        let attn: Vec<Tensor<2>> = caches
            .iter_mut()
            .enumerate()
            .map(|(i, c)| {
                let pos = c.len();
                let rows = qkv.clone().narrow(0, offsets[i], ns[i]);
                self.attention_rows(l, rows, c, At::Next(pos)).0
            })
            .collect();
        Tensor::cat(attn, 0)
    }

    /// The rest of a block after attention: output projection, residual, MLP. Row-wise, so the
    /// rows of several sequences go through it as one batch.
    ///
    /// # Shapes
    /// - h: `[m, hidden]`, attn: `[m, q_dim]` → `[m, hidden]`
    fn block_after_attention(&self, l: usize, h: Tensor<2>, attn: Tensor<2>) -> Tensor<2> {
        let layer = &self.layers[l];
        let cfg = &self.config;
        #[cfg(feature = "flex")]
        if self.fused_block(l) {
            let h = self.linear_add(attn, &layer.o_proj, h);
            let x = self.rms_norm(h.clone(), Some(&layer.post_attention_layernorm));
            let gu = self.linear(x, &layer.gate_up_proj);
            let act = crate::cpu::swiglu(gu);
            return self.linear_add(act, &layer.down_proj, h);
        }
        let mut out = self.linear(attn, &layer.o_proj);
        if let Some(b) = &layer.o_bias {
            out = out + b.clone().unsqueeze_dim::<2>(0);
        }
        let (pre_mlp, post_mlp) = if cfg.sandwich_norms {
            // Gemma 3: the attention output is normed before the residual add, and the MLP
            // sits between its own pre- and post-norms.
            out = self.rms_norm(out, Some(&layer.post_attention_layernorm));
            (
                layer.pre_feedforward_layernorm.as_ref(),
                layer.post_feedforward_layernorm.as_ref(),
            )
        } else {
            (Some(&layer.post_attention_layernorm), None)
        };
        let h = h + out;

        let x = self.rms_norm(h.clone(), pre_mlp);
        let ff = cfg.intermediate_size;
        let gate_up = self.linear(x, &layer.gate_up_proj);
        let gate = gate_up.clone().narrow(1, 0, ff);
        let gate = match cfg.hidden_act {
            Activation::Silu => activation::silu(gate),
            Activation::GeluTanh => gelu_tanh(gate),
        };
        let up = gate_up.narrow(1, ff, ff);
        let y = self.linear(gate * up, &layer.down_proj);
        let y = match post_mlp {
            Some(w) => self.rms_norm(y, Some(w)),
            None => y,
        };
        h + y
    }

    /// Causal grouped-query attention over all `t` cached positions: query `i` sees the first
    /// `seen[i]` keys, or with `seen` empty the queries are the last `m` positions; with a
    /// `window`, only the last `window` of those (the layer's slots are taken to be consecutive
    /// positions, as they are everywhere but in the `drop` baseline's upper layers).
    ///
    /// # Shapes
    /// - q: `[1, heads, m, hd]`, k/v: `[1, kv_heads, t, hd]` → `[1, heads, m, hd]`
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        heads: usize,
        kv_heads: usize,
        seen: &[usize],
        window: Option<usize>,
    ) -> Tensor<4> {
        let group = heads / kv_heads;
        let [_, _, t, hd] = k.dims();
        let (k, v) = if group == 1 {
            (k, v)
        } else {
            let rep = |x: Tensor<4>| {
                x.unsqueeze_dim::<5>(2)
                    .expand([1, kv_heads, group, t, hd])
                    .reshape([1, heads, t, hd])
            };
            (rep(k), rep(v))
        };
        let m = q.dims()[2];
        let seen: Vec<usize> = if seen.is_empty() && window.is_some() {
            (0..m).map(|i| t - m + i + 1).collect()
        } else {
            seen.to_vec()
        };
        let mask = (!seen.is_empty()).then(|| {
            let w = window.unwrap_or(usize::MAX);
            let bits: Vec<bool> = seen
                .iter()
                .flat_map(|&s| {
                    let lo = s.saturating_sub(w);
                    (0..t).map(move |j| j >= s || j < lo)
                })
                .collect();
            Tensor::<4, Bool>::from_data(TensorData::new(bits, [1, 1, m, t]), &self.device)
                .expand([1, heads, m, t])
        });
        // Without a mask, causal masking is aligned bottom-right: query i sits at t - m + i.
        let c = &self.config;
        let opts = AttentionModuleOptions {
            scale: c.query_pre_attn_scalar.map(|_| c.attention_scale()),
            softcap: c.attn_logit_softcapping,
            is_causal: mask.is_none(),
        };
        attention(q, k, v, mask, None, opts)
    }

    /// Final norm and output head.
    ///
    /// # Shapes
    /// - h: `[m, hidden]` → `[m, vocab]`
    pub fn head(&self, h: Tensor<2>) -> Tensor<2> {
        let logits = self.linear(self.rms_norm(h, Some(&self.norm)), &self.lm_head);
        match self.config.final_logit_softcapping {
            Some(cap) => softcap(logits, cap),
            None => logits,
        }
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
    /// Row `i` equals [`Llama::decode_step`] of sequence `i` alone.
    ///
    /// # Shapes
    /// - tokens: `[b]` → `[b, vocab]`
    pub fn decode_batch(&self, tokens: &[u32], caches: &mut [&mut KvCache]) -> Result<Tensor<2>> {
        let rows: Vec<&[u32]> = tokens.chunks(1).collect();
        self.forward_batch(&rows, caches)
    }

    /// Prefill of several prompts at once, each continuing its own cache: round `k` takes chunk
    /// `k` ([`PREFILL_CHUNK`] tokens) of every prompt that has one, and runs those rows together
    /// ([`Llama::forward_batch`]). Row `i` of the result equals [`Llama::prefill`] of prompt `i`
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
        for k in 0..rounds.unwrap_or(0) {
            let live: Vec<usize> = (0..prompts.len())
                .filter(|&i| k * PREFILL_CHUNK < prompts[i].len())
                .collect();
            let chunks: Vec<&[u32]> = live
                .iter()
                .map(|&i| {
                    let p = prompts[i];
                    &p[k * PREFILL_CHUNK..((k + 1) * PREFILL_CHUNK).min(p.len())]
                })
                .collect();
            let mut cs: Vec<&mut KvCache> = caches
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| k * PREFILL_CHUNK < prompts[*i].len())
                .map(|(_, c)| &mut **c)
                .collect();
            let logits = self.forward_batch(&chunks, &mut cs)?;
            for (j, &i) in live.iter().enumerate() {
                last[i] = Some(logits.clone().narrow(0, j, 1));
            }
        }
        let last: Vec<Tensor<2>> = last.into_iter().flatten().collect();
        Ok(Tensor::cat(last, 0))
    }

    /// New rows of several sequences at once, `tokens[i]` appended to `caches[i]` (a prompt
    /// chunk, or one decode token): every projection and the MLP run as one matmul over all the
    /// rows (the weights are read once, not once per sequence); attention runs per sequence on
    /// its own cache. Row `i` of the result equals running `tokens[i]` alone.
    ///
    /// # Shapes
    /// - tokens: `b` slices of `n_i ≥ 1` tokens → `[b, vocab]`, the logits after each slice
    pub fn forward_batch(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
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
            let qkv = self.qkv(l, h.clone());
            let attn = self.attention_batch(l, qkv, &ns, caches);
            h = self.block_after_attention(l, h, attn);
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

    fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<2>> {
        let pos = cache.len();
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, 0..self.num_layers(), cache, pos)?;
        cache.set_len(pos + tokens.len());
        Ok(h)
    }
}

impl Llama {
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

/// `cap · tanh(x / cap)`.
pub(crate) fn softcap<const D: usize>(x: Tensor<D>, cap: f64) -> Tensor<D> {
    x.div_scalar(cap).tanh().mul_scalar(cap)
}

/// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`); `x·x·x` rather than a
/// power, which GPUs leave undefined for negative bases.
fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube.mul_scalar(0.044_715)).mul_scalar(SQRT_2_OVER_PI);
    x * inner.tanh().add_scalar(1.0).mul_scalar(0.5)
}
