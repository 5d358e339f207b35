//! Fidelity of a prefill method against full prefill: each method prefills a prefix, then the
//! continuation is teacher-forced with the full model on top of that cache.

use burn::tensor::{FloatDType, Int, Tensor, TensorData, activation};
use ridgefill_io::config::ModelConfig;

use crate::decoder::Decoder;
use crate::error::Result;
use crate::fill::{FillMaps, FillRows};
use crate::fill::{FillOptions, FillReport, Filled, Prefill};

/// How the prefix is prefilled.
#[derive(Clone, Copy)]
pub enum Method<'a> {
    /// Every row runs every layer (the reference).
    Full,
    /// Layers `split..L` skipped for the bulk rows, their K/V predicted by `maps`.
    Fill(&'a FillMaps, FillRows),
    /// Layers `split..L` never see the bulk rows.
    Drop(usize, FillRows),
}

/// Per-window sums over the continuation tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowStats {
    pub tokens: usize,
    pub nll: f64,
    pub kl: f64,
    pub top1: usize,
}

impl WindowStats {
    pub fn add(&mut self, o: &WindowStats) {
        self.tokens += o.tokens;
        self.nll += o.nll;
        self.kl += o.kl;
        self.top1 += o.top1;
    }
}

/// Prefills `tokens` into an empty cache by `method`; returns last-position logits.
///
/// # Shapes
/// - tokens: `[n]` → `[vocab]`
pub fn prefill_with(
    model: &Decoder,
    tokens: &[u32],
    cache: &mut crate::KvCache,
    method: Method,
) -> Result<Tensor<1>> {
    Ok(prefill_with_spans(model, tokens, cache, method)?.logits)
}

/// [`prefill_with`], also returning the bulk spans that ran exactly (none unless `method`
/// fills with chosen spans) and what the prefill filled.
///
/// # Shapes
/// - tokens: `[n]` → logits `[vocab]`
pub fn prefill_with_spans(
    model: &Decoder,
    tokens: &[u32],
    cache: &mut crate::KvCache,
    method: Method,
) -> Result<Filled> {
    match method {
        Method::Full => Ok(Filled {
            logits: model.prefill(tokens, cache)?,
            spans: Vec::new(),
            report: FillReport {
                prompt: tokens.len(),
                tail: tokens.len(),
                ..FillReport::default()
            },
            history: None,
        }),
        Method::Fill(maps, rows) => {
            Prefill::run(model, tokens, cache, FillOptions::fill(maps, rows))
        }
        Method::Drop(split, rows) => {
            Prefill::run(model, tokens, cache, FillOptions::drop(split, rows))
        }
    }
}

/// Log-probabilities predicting each continuation token, continuing a `cache` prefilled
/// with the prompt whose last-position logits are `last`.
///
/// # Shapes
/// - last: `[vocab]`, cont: `[c]` → `[c, vocab]`
pub fn continue_logp(
    model: &Decoder,
    last: Tensor<1>,
    cont: &[u32],
    cache: &mut crate::KvCache,
) -> Result<Tensor<2>> {
    let vocab = model.config.vocab_size;
    let mut parts = vec![last.reshape([1, vocab])];
    if cont.len() > 1 {
        parts.push(model.forward_all_logits(&cont[..cont.len() - 1], cache)?);
    }
    Ok(activation::log_softmax(
        Tensor::cat(parts, 0).cast(FloatDType::F32),
        1,
    ))
}

/// Log-probabilities predicting each continuation token after prefilling `prefix` by `method`.
///
/// # Shapes
/// - prefix: `[p]`, cont: `[c]` → `[c, vocab]`
pub fn continuation_logp(
    model: &Decoder,
    prefix: &[u32],
    cont: &[u32],
    method: Method,
) -> Result<Tensor<2>> {
    let mut cache = model.new_cache(prefix.len() + cont.len());
    let last = prefill_with(model, prefix, &mut cache, method)?;
    continue_logp(model, last, cont, &mut cache)
}

/// NLL of `cont`, KL(reference ‖ method) and top-1 agreement, on the host.
///
/// # Shapes
/// - logp, reference: `[c, vocab]`, cont: `[c]`
pub fn compare_logp(
    model: &Decoder,
    logp: Tensor<2>,
    reference: Tensor<2>,
    cont: &[u32],
) -> WindowStats {
    let c = cont.len();
    let targets: Vec<i32> = cont.iter().map(|&t| t as i32).collect();
    let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [c, 1]), &model.device);
    let nll = crate::to_host_f32(logp.clone().gather(1, targets).neg());
    let kl = crate::to_host_f32(
        (reference.clone().exp() * (reference.clone() - logp.clone())).sum_dim(1),
    );
    let a = crate::to_host_f32(logp.argmax(1).float());
    let b = crate::to_host_f32(reference.argmax(1).float());
    WindowStats {
        tokens: c,
        nll: nll.iter().map(|&x| x as f64).sum(),
        kl: kl.iter().map(|&x| x as f64).sum(),
        top1: a.iter().zip(&b).filter(|(x, y)| x == y).count(),
    }
}

/// Matmul FLOPs of one token through one layer's projections and MLP.
fn token_layer_flops(c: &ModelConfig) -> f64 {
    let (d, q, kv, ff) = (
        c.hidden_size as f64,
        c.q_dim() as f64,
        c.kv_dim() as f64,
        c.intermediate_size as f64,
    );
    2.0 * d * (q + 2.0 * kv) + 2.0 * q * d + 2.0 * d * 2.0 * ff + 2.0 * ff * d
}

/// Attention FLOPs of one query row over `keys` keys (QKᵀ and AV over every head).
fn attention_flops(c: &ModelConfig, keys: usize) -> f64 {
    4.0 * keys as f64 * c.q_dim() as f64
}

/// One row through layer `l` seeing `keys` keys (at most its window on a sliding layer).
fn row_flops(c: &ModelConfig, l: usize, keys: usize) -> f64 {
    token_layer_flops(c) + attention_flops(c, keys.min(c.layer_window(l).unwrap_or(usize::MAX)))
}

/// A skip method, as far as its cost goes.
#[derive(Clone, Copy, Debug)]
pub struct Skip {
    pub split: usize,
    pub rows: FillRows,
    /// Bulk K/V predicted by maps (`fill`), or left out of the upper layers (`drop`).
    pub filled: bool,
    /// Maps updated per prompt from the exact rows.
    pub adapt: bool,
    /// Sliding-window layers filled in every row, read or not ([`FillMaps::fill_unread`]).
    pub fill_unread: bool,
}

/// Rows the fill writes in layer `l` of an `n`-row prompt: all of them on a full-attention
/// layer; on a sliding one those within its window of an exact row (spans counted as if spread
/// apart, each reaching a window of its own).
pub fn filled_rows(c: &ModelConfig, l: usize, n: usize, rows: FillRows) -> usize {
    let Some(bulk) = rows.bulk(n) else {
        return 0;
    };
    let Some(window) = c.layer_window(l) else {
        return n;
    };
    let spans = rows.span_count(n);
    let reach = window.saturating_sub(1) * (1 + spans);
    bulk.len().min(reach + rows.exact_rows(n))
}

/// Prefill FLOPs of `n` tokens, by full prefill or a skip method. Chosen spans are counted at
/// their full budget, attending on average to half the prompt; sliding-window layers count
/// only the keys in their window.
pub fn prefill_flops(c: &ModelConfig, n: usize, skip: Option<Skip>) -> f64 {
    let layers = c.num_hidden_layers;
    let head = 2.0 * c.hidden_size as f64 * c.vocab_size as f64;
    let full_layer = |l: usize| causal_layer_flops(c, l, n);
    let bulk = skip.and_then(|s| s.rows.bulk(n).map(|b| (s, b)));
    let Some((skip, bulk)) = bulk else {
        return (0..layers).map(full_layer).sum::<f64>() + head;
    };
    let (sink, tail0) = (bulk.start, bulk.end);
    let (f, kv2) = (c.hidden_size as f64 + 1.0, 2.0 * c.kv_dim() as f64);
    let spans = skip.rows.exact_rows(n);
    let mut total: f64 = (0..skip.split).map(full_layer).sum();
    for l in skip.split..layers {
        for i in (0..sink).chain(tail0..n) {
            let keys = if skip.filled || i < sink {
                i + 1
            } else {
                sink + (i - tail0) + 1
            };
            total += row_flops(c, l, keys);
        }
        if skip.filled {
            total += spans as f64 * row_flops(c, l, sink + bulk.len() / 2 + 1);
            // Features through the layer's maps (exact rows' slots are overwritten).
            let rows = match skip.fill_unread {
                true => n,
                false => filled_rows(c, l, n, skip.rows),
            };
            total += rows as f64 * 2.0 * f * kv2;
        }
    }
    if !skip.filled {
        return total + head;
    }
    let upper = (layers - skip.split) as f64;
    let (d, q) = (c.hidden_size as f64, c.q_dim() as f64);
    let scoring = if skip.rows.span_count(n) > 0 {
        let t = (n - tail0) as f64;
        t * (2.0 * d * q + 2.0 * n as f64 * q)
    } else {
        0.0
    };
    let adapt = if skip.adapt {
        let k = (n - tail0 + spans) as f64;
        let once = 2.0 * f * f * k + 2.0 * k * f * k + k * k * k / 3.0;
        let per_layer = 2.0 * k * f * kv2 + 2.0 * k * k * kv2 + 2.0 * f * k * kv2 + f * kv2;
        once + per_layer * upper
    } else {
        0.0
    };
    total + scoring + adapt + head
}

/// FLOPs of full prefill of `n` tokens after `depth` cached positions (a follow-up turn over a
/// reused prefix), plus `restored` earlier rows re-run through the layers from `split` up
/// (skip-and-fill over a filled prefix), each counted attending to half the prefix.
pub fn prefill_flops_at(c: &ModelConfig, depth: usize, n: usize, restored: (usize, usize)) -> f64 {
    let head = 2.0 * c.hidden_size as f64 * c.vocab_size as f64;
    let (split, rows) = restored;
    (0..c.num_hidden_layers)
        .map(|l| {
            let new: f64 = (0..n).map(|i| row_flops(c, l, depth + i + 1)).sum();
            let old = if l >= split { rows } else { 0 };
            new + old as f64 * row_flops(c, l, depth / 2 + 1)
        })
        .sum::<f64>()
        + head
}

/// Full prefill's FLOPs in layers `from..` as a share of its whole: what a prefill whose
/// self-check failed at split `from` runs again, every row exactly, after its planned pass.
pub fn upper_share(c: &ModelConfig, n: usize, from: usize) -> f64 {
    let upper: f64 = (from..c.num_hidden_layers)
        .map(|l| causal_layer_flops(c, l, n))
        .sum();
    upper / prefill_flops(c, n, None)
}

/// FLOPs of layer `l` over `n` prompt rows, row `i` attending to the first `i + 1`.
fn causal_layer_flops(c: &ModelConfig, l: usize, n: usize) -> f64 {
    (0..n).map(|i| row_flops(c, l, i + 1)).sum()
}

/// FLOPs of one decode step with `ctx` positions already cached.
pub fn decode_flops(c: &ModelConfig, ctx: usize) -> f64 {
    let head = 2.0 * c.hidden_size as f64 * c.vocab_size as f64;
    (0..c.num_hidden_layers)
        .map(|l| row_flops(c, l, ctx + 1))
        .sum::<f64>()
        + head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_share_is_full_prefill_above_the_split() {
        let c = crate::synthetic::shape("smollm2-135m").unwrap();
        let (n, layers) = (512, c.num_hidden_layers);
        let total = prefill_flops(&c, n, None);
        let head = 2.0 * c.hidden_size as f64 * c.vocab_size as f64;
        // Every layer again is all of it but the head; no layer, nothing.
        assert!((upper_share(&c, n, 0) - (1.0 - head / total)).abs() < 1e-12);
        assert_eq!(upper_share(&c, n, layers), 0.0);
        // SmolLM2's layers are alike: the top half is half the layers' work.
        let half = upper_share(&c, n, layers / 2);
        assert!((half - upper_share(&c, n, 0) / 2.0).abs() < 1e-12, "{half}");
    }
}
