//! A plain f64 forward written from the transformers definitions of Llama, Qwen2, Qwen3 and
//! Gemma 3 (the family switches read from the config), for the decoder's numerics to be checked
//! against. Its weights come from either source: a checkpoint's tensors by their Hugging Face
//! names ([`Reference::from_checkpoint`], which checks loading too), or a loaded [`Decoder`]'s own
//! tensors, dense or in blocks ([`Reference::from_decoder`]).

use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::config::{Activation, ModelConfig};
use ridgefill_model::{Decoder, Tensor, to_host_f32};

/// One block's weights; matrices are row-major `[in, out]`, as `x · W` reads them.
struct Layer {
    window: Option<usize>,
    rope_theta: f64,
    pre_attn_norm: Vec<f64>,
    /// q, k and v side by side: `[hidden, q_dim + 2 kv_dim]`.
    qkv: Vec<f64>,
    qkv_bias: Option<Vec<f64>>,
    q_norm: Option<Vec<f64>>,
    k_norm: Option<Vec<f64>>,
    o_proj: Vec<f64>,
    o_bias: Option<Vec<f64>>,
    post_attn_norm: Option<Vec<f64>>,
    pre_mlp_norm: Vec<f64>,
    post_mlp_norm: Option<Vec<f64>>,
    /// Gate and up side by side: `[hidden, 2 intermediate]`.
    gate_up: Vec<f64>,
    down: Vec<f64>,
}

/// A model's weights in f64, ready for [`Reference::logits`].
pub struct Reference {
    config: ModelConfig,
    /// `[vocab, hidden]`.
    embed: Vec<f64>,
    layers: Vec<Layer>,
    norm: Vec<f64>,
    /// `[hidden, vocab]`.
    lm_head: Vec<f64>,
}

fn host<const D: usize>(t: &Tensor<D>) -> Vec<f64> {
    to_host_f32(t.clone()).into_iter().map(f64::from).collect()
}

/// An HF `[out, in]` weight as `[in, out]`.
fn transpose(w: &[f32], out: usize) -> Vec<f64> {
    let inp = w.len() / out;
    let mut t = vec![0.0; w.len()];
    for o in 0..out {
        for i in 0..inp {
            t[i * out + o] = f64::from(w[o * inp + i]);
        }
    }
    t
}

/// `[in, a]` and `[in, b]` side by side as `[in, a + b]`, and so on.
fn side_by_side(parts: &[Vec<f64>], inp: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for i in 0..inp {
        for p in parts {
            let w = p.len() / inp;
            out.extend_from_slice(&p[i * w..(i + 1) * w]);
        }
    }
    out
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

/// `x · W` for a row-major `[in, out]` weight.
fn vecmat(x: &[f64], w: &[f64]) -> Vec<f64> {
    let out = w.len() / x.len();
    let mut y = vec![0.0; out];
    for (i, xi) in x.iter().enumerate() {
        for (o, yo) in y.iter_mut().enumerate() {
            *yo += xi * w[i * out + o];
        }
    }
    y
}

/// Rotates halves (transformers' `rotate_half`): pairs `(i, i + head_dim / 2)`.
fn rope(x: &mut [f64], pos: usize, theta: f64) {
    let hd = x.len();
    let half = hd / 2;
    for i in 0..half {
        let f = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
        let (s, c) = (pos as f64 * f).sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

fn softcap(x: f64, cap: Option<f64>) -> f64 {
    cap.map_or(x, |c| c * (x / c).tanh())
}

fn add(y: &mut [f64], b: &[f64]) {
    y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
}

impl Reference {
    /// The weights of a checkpoint, read by their Hugging Face names (dequantised where stored in
    /// blocks); windows and RoPE bases per layer as the config says.
    pub fn from_checkpoint(ck: &Checkpoint) -> Reference {
        let c = ck.config.clone();
        assert!(
            c.rope_scaling.is_none(),
            "the reference has no RoPE scaling"
        );
        let d = c.hidden_size;
        let w = |n: &str| ck.tensor_f32(n).unwrap_or_else(|e| panic!("{n}: {e}"));
        let opt = |n: &str| ck.has_tensor(n).then(|| w(n));
        let f64s = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
        // Gemma stores norm weights as offsets from 1.
        let norm = |v: Vec<f32>| {
            v.into_iter()
                .map(|x| f64::from(x) + c.norm_weight_offset)
                .collect::<Vec<f64>>()
        };
        let embed = f64s(w("model.embed_tokens.weight"));
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                let p = |s: &str| format!("model.layers.{l}.{s}");
                let proj = |s: &str, out: usize| transpose(&w(&p(s)), out);
                let qkv = side_by_side(
                    &[
                        proj("self_attn.q_proj.weight", c.q_dim()),
                        proj("self_attn.k_proj.weight", c.kv_dim()),
                        proj("self_attn.v_proj.weight", c.kv_dim()),
                    ],
                    d,
                );
                let qkv_bias = opt(&p("self_attn.q_proj.bias")).map(|q| {
                    let mut b = f64s(q);
                    b.extend(f64s(w(&p("self_attn.k_proj.bias"))));
                    b.extend(f64s(w(&p("self_attn.v_proj.bias"))));
                    b
                });
                let ff = c.intermediate_size;
                let gate_up = side_by_side(
                    &[
                        proj("mlp.gate_proj.weight", ff),
                        proj("mlp.up_proj.weight", ff),
                    ],
                    d,
                );
                // Gemma's sandwich: post_attention_layernorm closes the attention, the MLP has
                // its own pair; elsewhere post_attention_layernorm opens the MLP.
                let (post_attn_norm, pre_mlp_norm, post_mlp_norm) = if c.sandwich_norms {
                    (
                        Some(norm(w(&p("post_attention_layernorm.weight")))),
                        norm(w(&p("pre_feedforward_layernorm.weight"))),
                        Some(norm(w(&p("post_feedforward_layernorm.weight")))),
                    )
                } else {
                    (None, norm(w(&p("post_attention_layernorm.weight"))), None)
                };
                Layer {
                    window: c.layer_window(l),
                    rope_theta: if c.layer_uses_local_rope(l) {
                        c.rope_local_base_freq.unwrap()
                    } else {
                        c.rope_theta
                    },
                    pre_attn_norm: norm(w(&p("input_layernorm.weight"))),
                    qkv,
                    qkv_bias,
                    q_norm: opt(&p("self_attn.q_norm.weight")).map(norm),
                    k_norm: opt(&p("self_attn.k_norm.weight")).map(norm),
                    o_proj: proj("self_attn.o_proj.weight", d),
                    o_bias: opt(&p("self_attn.o_proj.bias")).map(f64s),
                    post_attn_norm,
                    pre_mlp_norm,
                    post_mlp_norm,
                    gate_up,
                    down: proj("mlp.down_proj.weight", d),
                }
            })
            .collect();
        let lm_head = if ck.has_tensor("lm_head.weight") && !c.tie_word_embeddings {
            transpose(&w("lm_head.weight"), c.vocab_size)
        } else {
            let e: Vec<f32> = embed.iter().map(|&x| x as f32).collect();
            transpose(&e, c.vocab_size)
        };
        Reference {
            norm: norm(w("model.norm.weight")),
            config: c,
            embed,
            layers,
            lm_head,
        }
    }

    /// The weights a loaded model holds (dense, or decoded from its blocks), with each layer's
    /// window and RoPE base as the model has them.
    pub fn from_decoder(m: &Decoder) -> Reference {
        let c = m.config.clone();
        assert!(
            c.rope_scaling.is_none(),
            "the reference has no RoPE scaling"
        );
        let dense = |w: &ridgefill_model::Weight| host(&w.dense(&m.device, m.dtype));
        let layers = m
            .layers
            .iter()
            .map(|layer| Layer {
                window: layer.window,
                rope_theta: if layer.local_rope {
                    c.rope_local_base_freq.unwrap()
                } else {
                    c.rope_theta
                },
                pre_attn_norm: host(&layer.pre_attn_norm),
                qkv: dense(&layer.qkv_proj),
                qkv_bias: layer.qkv_bias.as_ref().map(host),
                q_norm: layer.q_norm.as_ref().map(host),
                k_norm: layer.k_norm.as_ref().map(host),
                o_proj: dense(&layer.o_proj),
                o_bias: layer.o_bias.as_ref().map(host),
                post_attn_norm: layer.post_attn_norm.as_ref().map(host),
                pre_mlp_norm: host(&layer.pre_mlp_norm),
                post_mlp_norm: layer.post_mlp_norm.as_ref().map(host),
                gate_up: dense(&layer.gate_up_proj),
                down: dense(&layer.down_proj),
            })
            .collect();
        Reference {
            embed: host(&m.embed_tokens.embedding_dense(&m.device, m.dtype)),
            layers,
            norm: host(&m.norm),
            lm_head: dense(&m.lm_head),
            config: c,
        }
    }

    /// Replaces every layer's sliding window (`None`: full attention).
    pub fn with_windows(mut self, windows: &[Option<usize>]) -> Reference {
        assert_eq!(windows.len(), self.layers.len());
        for (layer, &w) in self.layers.iter_mut().zip(windows) {
            layer.window = w;
        }
        self
    }

    /// The logits of every position of `tokens`.
    pub fn logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let c = &self.config;
        let (d, hd, nh, nkv) = (
            c.hidden_size,
            c.head_dim(),
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (q_dim, kv_dim, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let eps = c.rms_norm_eps;
        let scale = c.embed_scale.map_or(1.0, |s| f64::from(s as f32));
        let mut hs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| {
                let row = &self.embed[t as usize * d..(t as usize + 1) * d];
                row.iter().map(|v| v * scale).collect()
            })
            .collect();
        let n = hs.len();
        let att_scale = 1.0 / c.query_pre_attn_scalar.unwrap_or(hd as f64).sqrt();
        let group = nh / nkv;
        for layer in &self.layers {
            let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
            for (pos, h) in hs.iter().enumerate() {
                let mut y = vecmat(&rms_norm(h, &layer.pre_attn_norm, eps), &layer.qkv);
                if let Some(b) = &layer.qkv_bias {
                    add(&mut y, b);
                }
                let mut q = y[..q_dim].to_vec();
                let mut k = y[q_dim..q_dim + kv_dim].to_vec();
                for (x, w) in [(&mut q, &layer.q_norm), (&mut k, &layer.k_norm)] {
                    for head in x.chunks_mut(hd) {
                        if let Some(w) = w {
                            let normed = rms_norm(head, w, eps);
                            head.copy_from_slice(&normed);
                        }
                        rope(head, pos, layer.rope_theta);
                    }
                }
                qs.push(q);
                ks.push(k);
                vs.push(y[q_dim + kv_dim..].to_vec());
            }
            for i in 0..n {
                let lo = layer.window.map_or(0, |w| (i + 1).saturating_sub(w));
                let mut attn = vec![0.0; q_dim];
                for h in 0..nh {
                    let kvh = h / group;
                    let q = &qs[i][h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = (lo..=i)
                        .map(|j| {
                            let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                            let s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * att_scale;
                            softcap(s, c.attn_logit_softcapping)
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (jj, ej) in e.iter().enumerate() {
                        let j = lo + jj;
                        for t in 0..hd {
                            attn[h * hd + t] += ej / z * vs[j][kvh * hd + t];
                        }
                    }
                }
                let mut o = vecmat(&attn, &layer.o_proj);
                if let Some(b) = &layer.o_bias {
                    add(&mut o, b);
                }
                if let Some(w) = &layer.post_attn_norm {
                    o = rms_norm(&o, w, eps);
                }
                add(&mut hs[i], &o);
                let gu = vecmat(&rms_norm(&hs[i], &layer.pre_mlp_norm, eps), &layer.gate_up);
                let act: Vec<f64> = (0..ff)
                    .map(|j| {
                        let (g, u) = (gu[j], gu[ff + j]);
                        let a = match c.hidden_act {
                            Activation::Silu => g / (1.0 + (-g).exp()),
                            Activation::GeluTanh => {
                                let k = (2.0 / std::f64::consts::PI).sqrt();
                                0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh())
                            }
                        };
                        a * u
                    })
                    .collect();
                let mut y = vecmat(&act, &layer.down);
                if let Some(w) = &layer.post_mlp_norm {
                    y = rms_norm(&y, w, eps);
                }
                add(&mut hs[i], &y);
            }
        }
        hs.iter()
            .map(|h| {
                vecmat(&rms_norm(h, &self.norm, eps), &self.lm_head)
                    .into_iter()
                    .map(|x| softcap(x, c.final_logit_softcapping))
                    .collect()
            })
            .collect()
    }
}

/// The largest |a - b| of f32 values against f64 ones.
pub fn max_abs_diff_f64(a: &[f32], b: &[f64]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).abs() as f32)
        .fold(0.0, f32::max)
}
