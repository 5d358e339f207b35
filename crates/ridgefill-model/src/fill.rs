//! Skip-and-fill prefill: the bulk of the prompt runs layers `0..split` only, and the upper
//! layers' K/V for those rows are predicted by linear maps from the hidden state entering `split`.

use std::ops::Range;

use burn::tensor::{Bool, Device, FloatDType, Int, Tensor, TensorData, activation};

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::llama::{At, Llama, PREFILL_CHUNK};

/// Filled K/V that a diagnosis run replaces with the full model's (exact ones stay computed).
pub struct Oracle<'a> {
    /// The cache of a full prefill of the same prompt.
    pub truth: &'a KvCache,
    /// Upper layers restored.
    pub layers: Range<usize>,
    pub keys: bool,
    pub values: bool,
    /// Positions restored.
    pub rows: Vec<Range<usize>>,
}

impl Oracle<'_> {
    /// Overwrites layer `l`'s filled slots at `rows` with the truth, when `l` is restored.
    fn restore(&self, l: usize, cache: &mut KvCache) -> Result<()> {
        if !self.layers.contains(&l) {
            return Ok(());
        }
        let (tk, tv) = self.truth.read(l);
        let (fk, fv) = cache.read(l);
        for r in &self.rows {
            if r.end > tk.dims()[2] || r.end > fk.dims()[2] {
                return Err(ModelError::Invalid(format!(
                    "oracle rows {r:?} beyond the cache in layer {l}"
                )));
            }
            let pick = |t: &Tensor<4>, f: &Tensor<4>, truth: bool| {
                let src = if truth { t } else { f };
                src.clone().narrow(2, r.start, r.len())
            };
            cache.overwrite(
                l,
                r.start,
                pick(&tk, &fk, self.keys),
                pick(&tv, &fv, self.values),
            );
        }
        Ok(())
    }
}

/// All upper layers' fill maps as one matrix, so the bulk fill is a single GEMM.
pub struct FillMaps {
    /// First skipped layer.
    pub split: usize,
    /// `[hidden + 1, (layers - split) · 2 · kv_dim]`: per layer, K columns then V columns.
    pub w: Tensor<2>,
    /// The per-prompt update of the maps from the exactly computed rows, when the fill file
    /// carries what it needs.
    pub adapt: Option<Adapt>,
    /// Also fill sliding-window layers' rows that no exact row or decode step can reach (they
    /// are never read): only for measuring what leaving them out saves.
    pub fill_unread: bool,
}

/// What the per-prompt ridge update needs: the calibration precision and the exact rows' weight.
///
/// With calibration Gram `G = XᵀX + λD` and this prompt's exact rows `(Xe, Ye)` weighted `weight`
/// each, the maps that minimise both losses are `W' = W + P·(I/weight + Xe·P)⁻¹·(Ye − Xe·W)`
/// with `P = G⁻¹·Xeᵀ` (Woodbury): a rank-`k` correction computed layer by layer as the exact
/// rows' true K/V become known.
#[derive(Clone)]
pub struct Adapt {
    /// `G⁻¹`, `[hidden + 1, hidden + 1]`.
    pub precision: Tensor<2>,
    /// Weight of one exact row against one calibration row.
    pub weight: f64,
}

/// Default share of the prompt's rows run exactly in chosen spans (the shipped method's budget).
pub const DEFAULT_EXACT: f64 = 0.05;
/// Default weight of one exact row against one calibration row in the per-prompt update.
pub const DEFAULT_ADAPT_WEIGHT: f64 = 100.0;

/// How a fill file's maps are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillMethod {
    /// Every bulk row filled by the fitted maps.
    Ridge,
    /// Plus spans chosen by the tail's attention run exactly through the upper layers.
    Spans,
    /// Plus each upper layer's maps updated per prompt from the exact rows' true K/V.
    SpansAdapt,
}

impl FillMethod {
    /// The method `fit` records by default.
    pub const DEFAULT: FillMethod = FillMethod::SpansAdapt;
    pub const ALL: [FillMethod; 3] = [Self::Ridge, Self::Spans, Self::SpansAdapt];

    pub fn name(self) -> &'static str {
        match self {
            Self::Ridge => "ridge",
            Self::Spans => "spans",
            Self::SpansAdapt => "spans-adapt",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Maps and rows for this method: `maps` as loaded (with its update when the file has one),
    /// `rows` with the span budget to use; ridge drops both.
    pub fn configure(self, maps: &FillMaps, rows: FillRows) -> Result<(FillMaps, FillRows)> {
        match self {
            Self::Ridge => Ok((maps.plain(), FillRows { exact: 0.0, ..rows })),
            Self::Spans => Ok((maps.plain(), rows)),
            Self::SpansAdapt => {
                if maps.adapt.is_none() {
                    return Err(ModelError::Invalid(
                        "method spans-adapt needs a fill file with a precision matrix \
                         (fill.precision, written by `ridgefill fit` since format 2): fit again \
                         or choose --method spans"
                            .into(),
                    ));
                }
                Ok((
                    FillMaps {
                        adapt: maps.adapt.clone(),
                        ..maps.plain()
                    },
                    rows,
                ))
            }
        }
    }
}

impl std::fmt::Display for FillMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Fewest spans chosen: the tail's attention also points at the prompt's own question (asked
/// before a document) and at several facts, and on a short prompt a few spans cost little.
pub const MIN_SPANS: usize = 5;

/// Default half-width of an exact span: a needle sentence is ~16 tokens, centred on the top row.
pub const DEFAULT_SPAN_RADIUS: usize = 8;

/// Which rows of the prompt run every layer exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FillRows {
    /// First tokens (attention sinks) computed exactly.
    pub sink: usize,
    /// Last tokens computed exactly; the first generated token comes from the last of them.
    pub tail: usize,
    /// Share of the prompt's rows, beyond sink and tail, run exactly in spans chosen by the
    /// tail's attention in the last lower layer (0 = plain fill).
    pub exact: f64,
    /// Half-width of each exact span around a chosen row.
    pub span: usize,
}

impl Default for FillRows {
    /// Plain fill: sink 1, tail 16, no chosen spans.
    fn default() -> Self {
        Self {
            sink: 1,
            tail: 16,
            exact: 0.0,
            span: DEFAULT_SPAN_RADIUS,
        }
    }
}

impl FillRows {
    /// The bulk rows of an `n`-row prompt (neither sink nor tail), or `None` when every row runs
    /// exactly.
    pub fn bulk(&self, n: usize) -> Option<Range<usize>> {
        let sink = self.sink.min(n);
        (sink + self.tail < n).then(|| sink..n - self.tail)
    }

    /// Spans chosen in an `n`-row prompt: `exact · n` rows in spans of `2·span + 1`, and at least
    /// [`MIN_SPANS`] whenever the budget is positive.
    pub fn span_count(&self, n: usize) -> usize {
        if self.exact <= 0.0 {
            return 0;
        }
        let width = 2 * self.span + 1;
        ((self.exact * n as f64) / width as f64)
            .round()
            .max(MIN_SPANS as f64) as usize
    }

    /// The most bulk rows the chosen spans can cover in an `n`-row prompt (fewer when they
    /// overlap).
    pub fn exact_rows(&self, n: usize) -> usize {
        let bulk = self.bulk(n).map_or(0, |b| b.len());
        (self.span_count(n) * (2 * self.span + 1)).min(bulk)
    }
}

/// Exact rows inside `bulk`, at most `budget` of them: windows of `2·radius + 1` rows around
/// the best-scoring rows, best first, each window adding the rows it does not share with earlier
/// ones; a window that would overrun the budget is passed over. Neighbouring high scores thus
/// widen one span, so a fact sentence the query matches is covered whole, including the words
/// after the match that hold the answer. Returned sorted and merged.
pub fn choose_spans(
    scores: &[f32],
    bulk: Range<usize>,
    budget: usize,
    radius: usize,
) -> Vec<Range<usize>> {
    let budget = budget.min(bulk.len());
    let mut order: Vec<usize> = bulk.clone().collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut chosen = vec![false; bulk.len()];
    let mut used = 0;
    for p in order {
        if used == budget {
            break;
        }
        let window = p.saturating_sub(radius).max(bulk.start)..(p + radius + 1).min(bulk.end);
        let fresh = window.clone().filter(|&i| !chosen[i - bulk.start]).count();
        if fresh == 0 || used + fresh > budget {
            continue;
        }
        window.for_each(|i| chosen[i - bulk.start] = true);
        used += fresh;
    }
    let runs = chosen
        .iter()
        .enumerate()
        .filter(|(_, c)| **c)
        .map(|(i, _)| bulk.start + i..bulk.start + i + 1)
        .collect();
    merge(runs)
}

/// Filled rows a sliding-window layer needs: those within `window` keys of an exact row
/// (`exact` increasing; the last one is the prompt's last row, so decoding reaches no further
/// back), less the exact rows themselves, whose slots they overwrite.
pub fn window_reads(exact: &[usize], window: usize) -> Vec<Range<usize>> {
    let reach = merge(
        exact
            .iter()
            .map(|&p| (p + 1).saturating_sub(window)..p + 1)
            .collect(),
    );
    let mut out = Vec::new();
    let mut next_exact = exact.iter().peekable();
    for r in reach {
        let mut start = r.start;
        while let Some(&&p) = next_exact.peek() {
            if p >= r.end {
                break;
            }
            if p > start {
                out.push(start..p);
            }
            start = start.max(p + 1);
            next_exact.next();
        }
        if start < r.end {
            out.push(start..r.end);
        }
    }
    out
}

/// Sorts ranges and merges those that overlap or touch.
fn merge(mut spans: Vec<Range<usize>>) -> Vec<Range<usize>> {
    spans.sort_by_key(|s| s.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some(last) if s.start <= last.end => last.end = last.end.max(s.end),
            _ => out.push(s),
        }
    }
    out
}

/// Inverse of a symmetric positive definite `k × k` matrix (row-major) by Cholesky, in f64.
///
/// Hand-written: the engine reads fill files without `faer`, and `k` (the prompt's exact rows)
/// is a few hundred at most, so an O(k³) loop is microseconds to milliseconds.
fn spd_inverse(a: &[f64], k: usize) -> Result<Vec<f64>> {
    // Lower factor L with A = L·Lᵀ.
    let mut l = vec![0.0f64; k * k];
    for i in 0..k {
        for j in 0..=i {
            let dot: f64 = (0..j).map(|c| l[i * k + c] * l[j * k + c]).sum();
            let v = a[i * k + j] - dot;
            if i == j {
                if v.is_nan() || v <= 0.0 {
                    return Err(ModelError::Invalid(format!(
                        "per-prompt fill update: the exact rows' system is not positive definite \
                         (pivot {i} is {v})"
                    )));
                }
                l[i * k + i] = v.sqrt();
            } else {
                l[i * k + j] = v / l[j * k + j];
            }
        }
    }
    // Solve L·Lᵀ·X = I one column at a time.
    let mut inv = vec![0.0f64; k * k];
    let mut y = vec![0.0f64; k];
    for c in 0..k {
        for i in 0..k {
            let rhs = if i == c { 1.0 } else { 0.0 };
            let dot: f64 = (0..i).map(|j| l[i * k + j] * y[j]).sum();
            y[i] = (rhs - dot) / l[i * k + i];
        }
        for i in (0..k).rev() {
            let dot: f64 = (i + 1..k).map(|j| l[j * k + i] * inv[j * k + c]).sum();
            inv[i * k + c] = (y[i] - dot) / l[i * k + i];
        }
    }
    Ok(inv)
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
            adapt: None,
            fill_unread: false,
        })
    }

    /// Adds the per-prompt update from a host `[hidden + 1, hidden + 1]` precision matrix.
    pub fn with_adapt(
        mut self,
        precision: &[f32],
        weight: f64,
        dtype: FloatDType,
        device: &Device,
    ) -> Result<Self> {
        let f = self.w.dims()[0];
        if precision.len() != f * f {
            return Err(ModelError::Invalid(format!(
                "fill precision matrix: {} values, expected {f}×{f}",
                precision.len()
            )));
        }
        let p = TensorData::new(precision.to_vec(), [f, f]);
        self.adapt = Some(Adapt {
            precision: Tensor::<2>::from_data(p, device).cast(dtype),
            weight,
        });
        Ok(self)
    }

    /// The same maps without the per-prompt update (plain ridge); tensors are shared.
    pub fn plain(&self) -> Self {
        Self {
            split: self.split,
            w: self.w.clone(),
            adapt: None,
            fill_unread: self.fill_unread,
        }
    }

    /// The same maps filling every row of every layer, read or not (tensors are shared).
    pub fn filling_unread(&self) -> Self {
        Self {
            split: self.split,
            w: self.w.clone(),
            adapt: self.adapt.clone(),
            fill_unread: true,
        }
    }
}

/// A skip-and-fill prefill in progress (see [`Llama::fill_prefill_start`]).
pub struct FillPrefill {
    /// The prompt's embedded rows.
    h: Tensor<2>,
    rows: FillRows,
    /// First tail row.
    tail0: usize,
    /// Rows that have run the layers below the split.
    done: usize,
    /// The tail rows entering the scoring layer, per chunk.
    tail_in: Vec<Tensor<2>>,
    /// Every row entering the split, per chunk.
    h_split: Vec<Tensor<2>>,
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
    /// `h_split` (the starting point of SwiftKV): `W_l = diag(g_l) · [Wk_l | Wv_l]`, intercept the
    /// K/V biases (zero without). A q/k-norm model's K is not linear in its input; these maps
    /// leave that norm out.
    pub fn own_proj_maps(&self, split: usize) -> Result<FillMaps> {
        self.check_split(split)?;
        let (q_dim, kv_dim) = (self.config.q_dim(), self.config.kv_dim());
        let zero_row = Tensor::<2>::zeros([1, 2 * kv_dim], &self.device).cast(self.dtype);
        let cols: Vec<Tensor<2>> = self.layers[split..]
            .iter()
            .map(|layer| {
                let g = layer.input_layernorm.clone().unsqueeze_dim::<2>(1);
                let w = layer
                    .qkv_proj
                    .dense(&self.device, self.dtype)
                    .narrow(1, q_dim, 2 * kv_dim)
                    * g;
                let intercept = match &layer.qkv_bias {
                    Some(b) => b.clone().narrow(0, q_dim, 2 * kv_dim).unsqueeze_dim::<2>(0),
                    None => zero_row.clone(),
                };
                Tensor::cat(vec![w, intercept], 0)
            })
            .collect();
        Ok(FillMaps {
            split,
            w: Tensor::cat(cols, 1),
            adapt: None,
            fill_unread: false,
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
        // One GEMM for every upper layer's K and V.
        let y = self.linear_dense(self.fill_features(h_split), &maps.w);
        self.append_fill(y, maps.split, upper, cache, pos);
    }

    /// Appends the fill GEMM's output for layers `first..first + upper` to the cache at
    /// positions `pos..`: K rotated, V as is.
    ///
    /// # Shapes
    /// - y: `[b, upper·2·kv_heads·hd]`
    fn append_fill(
        &self,
        y: Tensor<2>,
        first: usize,
        upper: usize,
        cache: &mut KvCache,
        pos: usize,
    ) {
        let b = y.dims()[0];
        #[cfg(feature = "flex")]
        if self.cpu_kernels && cache.stored_dtype() == FloatDType::F32 {
            for i in 0..upper {
                let rope = self.rope_of(first + i).host(pos);
                cache.append_with(first + i, b, |k, v, at| {
                    crate::cpu::fill_kv_into(&y, i, rope, (k, v), at)
                });
            }
            return;
        }
        let (k, v) = self.split_fill(y, first, upper, b, pos);
        for i in 0..upper {
            let kl = k.clone().narrow(0, i, 1);
            let vl = v.clone().narrow(0, i, 1);
            cache.append(first + i, kl, vl);
        }
    }

    /// Every upper layer's K, rotated at its row's position, and V out of the fill GEMM's output
    /// for layers `first..first + upper`; layers with different RoPE tables are split apart.
    ///
    /// # Shapes
    /// - y: `[b, upper·2·kv_heads·hd]` → k and v `[upper, kv_heads, b, hd]`
    fn split_fill(
        &self,
        y: Tensor<2>,
        first: usize,
        upper: usize,
        b: usize,
        pos: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let same_rope =
            (first..first + upper).all(|l| std::ptr::eq(self.rope_of(l), self.rope_of(first)));
        if same_rope {
            return self.split_fill_rope(y, self.rope_of(first), upper, b, pos);
        }
        let kv2 = 2 * self.config.kv_dim();
        let (ks, vs): (Vec<_>, Vec<_>) = (0..upper)
            .map(|i| {
                let yi = y.clone().narrow(1, i * kv2, kv2);
                self.split_fill_rope(yi, self.rope_of(first + i), 1, b, pos)
            })
            .unzip();
        (Tensor::cat(ks, 0), Tensor::cat(vs, 0))
    }

    /// [`Llama::split_fill`] for layers that all rotate with `rope`.
    fn split_fill_rope(
        &self,
        y: Tensor<2>,
        rope: &crate::rope::Rope,
        upper: usize,
        b: usize,
        pos: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let (kvh, hd) = (self.config.num_key_value_heads, self.config.head_dim());
        #[cfg(feature = "flex")]
        if self.cpu_kernels {
            return crate::cpu::fill_kv(y, upper, kvh, hd, rope.host(pos));
        }
        // [b, upper·2·kvh, hd] → [upper, 2, kvh, b, hd]
        let y = y
            .reshape([b, upper * 2 * kvh, hd])
            .swap_dims(0, 1)
            .reshape([upper, 2, kvh, b, hd]);
        let k = y.clone().narrow(1, 0, 1).reshape([1, upper * kvh, b, hd]);
        let v = y.narrow(1, 1, 1).reshape([upper, kvh, b, hd]);
        // One RoPE op over every upper layer's keys.
        let k = rope.apply(k, pos).reshape([upper, kvh, b, hd]);
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
        Ok(self.prefill_fill_spans(tokens, cache, maps, rows)?.0)
    }

    /// [`Llama::prefill_fill`], also returning the bulk spans that ran exactly.
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[vocab]`
    pub fn prefill_fill_spans(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        maps: &FillMaps,
        rows: FillRows,
    ) -> Result<(Tensor<1>, Vec<Range<usize>>)> {
        self.prefill_skip_spans(tokens, cache, maps.split, Some(maps), rows, None)
    }

    /// [`Llama::prefill_fill_spans`] with some filled K/V replaced by the full model's before the
    /// exact rows read them: a diagnosis of which part of the fill loses what.
    ///
    /// # Shapes
    /// - tokens: `[n]` → `[vocab]`
    pub fn prefill_oracle(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        maps: &FillMaps,
        rows: FillRows,
        oracle: &Oracle,
    ) -> Result<(Tensor<1>, Vec<Range<usize>>)> {
        self.prefill_skip_spans(tokens, cache, maps.split, Some(maps), rows, Some(oracle))
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
        Ok(self
            .prefill_skip_spans(tokens, cache, split, maps, rows, None)?
            .0)
    }

    fn prefill_skip_spans(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        split: usize,
        maps: Option<&FillMaps>,
        rows: FillRows,
        oracle: Option<&Oracle>,
    ) -> Result<(Tensor<1>, Vec<Range<usize>>)> {
        if !cache.is_empty() {
            return Err(ModelError::Invalid(
                "skip-and-fill prefill needs an empty cache".into(),
            ));
        }
        self.check_split(split)?;
        let n = tokens.len();
        let layers = self.num_layers();
        let h = self.embed(tokens)?;
        let Some(bulk) = rows.bulk(n) else {
            let h = self.forward_layers_chunked(h, 0..layers, cache, 0)?;
            cache.set_len(n);
            let logits = self.head(h.narrow(0, n - 1, 1));
            return Ok((logits.reshape([self.config.vocab_size]), Vec::new()));
        };
        let mut chosen = Vec::new();
        let h_last = match maps {
            Some(maps) => {
                let scored = self.scoring_layer(split);
                let h_in = self.forward_layers_chunked(h, 0..scored, cache, 0)?;
                let h_split = self.forward_layers_chunked(h_in.clone(), scored..split, cache, 0)?;
                let tail_in = h_in.narrow(0, bulk.end, n - bulk.end);
                let (h_last, spans) =
                    self.fill_upper(maps, rows, tail_in, h_split, cache, oracle)?;
                chosen = spans;
                h_last
            }
            None => {
                let h = self.forward_layers_chunked(h, 0..split, cache, 0)?;
                let (sink, tail0) = (bulk.start, bulk.end);
                if sink > 0 {
                    self.forward_layers(h.clone().narrow(0, 0, sink), split..layers, cache, 0)?;
                }
                let t = self.forward_layers(
                    h.narrow(0, tail0, n - tail0),
                    split..layers,
                    cache,
                    tail0,
                )?;
                t.narrow(0, n - tail0 - 1, 1)
            }
        };
        cache.set_len(n);
        Ok((self.head(h_last).reshape([self.config.vocab_size]), chosen))
    }

    /// The layer whose attention chooses the spans runs apart, so its input is kept: the last
    /// full-attention layer below the split (a sliding one sees only the last `window` rows, so
    /// it could never point further back).
    fn scoring_layer(&self, split: usize) -> usize {
        (0..split)
            .rev()
            .find(|&l| self.layers[l].window.is_none())
            .unwrap_or(split - 1)
    }

    /// Everything of a fill prefill after the layers below the split: the spans the tail rows'
    /// attention chooses (from `tail_in`, the tail entering the scoring layer), then the upper
    /// layers' exact pass and fill. Returns the last row entering the head and the spans.
    ///
    /// # Shapes
    /// - tail_in: `[n - bulk.end, hidden]`, h_split: `[n, hidden]` → (`[1, hidden]`, spans)
    fn fill_upper(
        &self,
        maps: &FillMaps,
        rows: FillRows,
        tail_in: Tensor<2>,
        h_split: Tensor<2>,
        cache: &mut KvCache,
        oracle: Option<&Oracle>,
    ) -> Result<(Tensor<2>, Vec<Range<usize>>)> {
        let n = h_split.dims()[0];
        let bulk = rows
            .bulk(n)
            .ok_or_else(|| ModelError::Invalid("fill_upper: the prompt has no bulk".into()))?;
        let spans = if rows.span_count(n) > 0 {
            let scored = self.scoring_layer(maps.split);
            let scores = self.tail_scores(scored, tail_in, cache, bulk.end)?;
            choose_spans(&scores, bulk.clone(), rows.exact_rows(n), rows.span)
        } else {
            Vec::new()
        };
        let exact: Vec<usize> = (0..bulk.start)
            .chain(spans.iter().cloned().flatten())
            .chain(bulk.end..n)
            .collect();
        let h_last = self.exact_pass(maps, h_split, &exact, bulk.start, cache, oracle)?;
        Ok((h_last, spans))
    }

    /// Starts a skip-and-fill prefill that [`Llama::fill_prefill_step`] advances one chunk at a
    /// time, so a server can run other sequences' decode steps in between. `None` when the
    /// prompt has no bulk (every row runs every layer: use [`Llama::prefill`]).
    pub fn fill_prefill_start(
        &self,
        tokens: &[u32],
        cache: &KvCache,
        maps: &FillMaps,
        rows: FillRows,
    ) -> Result<Option<FillPrefill>> {
        if !cache.is_empty() {
            return Err(ModelError::Invalid(
                "skip-and-fill prefill needs an empty cache".into(),
            ));
        }
        self.check_split(maps.split)?;
        let n = tokens.len();
        let Some(bulk) = rows.bulk(n) else {
            return Ok(None);
        };
        Ok(Some(FillPrefill {
            h: self.embed(tokens)?,
            rows,
            tail0: bulk.end,
            done: 0,
            tail_in: Vec::new(),
            h_split: Vec::new(),
        }))
    }

    /// Runs the next [`PREFILL_CHUNK`] rows of `st` through the layers below the split; after
    /// the last chunk, the upper layers' exact pass and fill, returning the last-position
    /// logits. The same result as [`Llama::prefill_fill`].
    ///
    /// # Shapes
    /// - → `None` until the last step, then `[vocab]`
    pub fn fill_prefill_step(
        &self,
        st: &mut FillPrefill,
        cache: &mut KvCache,
        maps: &FillMaps,
    ) -> Result<Option<Tensor<1>>> {
        let n = st.h.dims()[0];
        let scored = self.scoring_layer(maps.split);
        if st.done < n {
            let (r0, r1) = (st.done, (st.done + PREFILL_CHUNK).min(n));
            let h = st.h.clone().narrow(0, r0, r1 - r0);
            let h_in = self.forward_layers(h, 0..scored, cache, r0)?;
            if r1 > st.tail0 {
                let from = st.tail0.max(r0);
                st.tail_in
                    .push(h_in.clone().narrow(0, from - r0, r1 - from));
            }
            st.h_split
                .push(self.forward_layers(h_in, scored..maps.split, cache, r0)?);
            st.done = r1;
            return Ok(None);
        }
        let tail_in = Tensor::cat(std::mem::take(&mut st.tail_in), 0);
        let h_split = Tensor::cat(std::mem::take(&mut st.h_split), 0);
        let (h_last, _) = self.fill_upper(maps, st.rows, tail_in, h_split, cache, None)?;
        cache.set_len(n);
        Ok(Some(self.head(h_last).reshape([self.config.vocab_size])))
    }

    /// Attention the `tail` rows (at positions `tail0..`) give every cached position of layer
    /// `l`, summed over heads and tail rows: the query's own choice of the rows that matter.
    ///
    /// # Shapes
    /// - tail: `[t, hidden]` entering layer `l` → `[tail0 + t]` on the host
    pub fn tail_scores(
        &self,
        l: usize,
        tail: Tensor<2>,
        cache: &KvCache,
        tail0: usize,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let (heads, kvh, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let t = tail.dims()[0];
        let q = self.qkv(l, tail).narrow(1, 0, heads * hd);
        let q = self.rope_of(l).apply(self.split_heads(q, heads), tail0);
        let (k, _) = cache.read(l);
        let keys = k.dims()[2];
        let group = heads / kvh;
        let k = k
            .unsqueeze_dim::<5>(2)
            .expand([1, kvh, group, keys, hd])
            .reshape([1, heads, keys, hd]);
        let logits = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(cfg.attention_scale())
            .cast(FloatDType::F32);
        let logits = match cfg.attn_logit_softcapping {
            Some(cap) => crate::llama::softcap(logits, cap),
            None => logits,
        };
        // Tail row i sits at tail0 + i and sees keys 0..=tail0 + i (the last `window` of them
        // on a sliding-window layer).
        let window = self.layers[l].window.unwrap_or(usize::MAX);
        let bits: Vec<bool> = (0..t)
            .flat_map(|i| {
                let lo = (tail0 + i + 1).saturating_sub(window);
                (0..keys).map(move |j| j > tail0 + i || j < lo)
            })
            .collect();
        let mask =
            Tensor::<4, Bool>::from_data(TensorData::new(bits, [1, 1, t, keys]), &self.device)
                .expand([1, heads, t, keys]);
        let p = activation::softmax(logits.mask_fill(mask, f32::NEG_INFINITY), 3);
        let s = crate::to_host_f32(p.sum_dim(1).sum_dim(2).reshape([keys]));
        if let Some(i) = s.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::Invalid(format!(
                "non-finite attention score at position {i} in layer {l}"
            )));
        }
        Ok(s)
    }

    /// Runs rows at positions `exact` (increasing: sink, chosen spans, tail) through the upper
    /// layers in one batch, over a cache whose upper layers hold a filled slot for every
    /// position; each exact row overwrites its slot and attends to every slot up to its own.
    /// With `maps.adapt`, each layer's maps are first updated from the exact rows at or after
    /// `sink` (their true K/V at that layer). Returns the last exact row's hidden state.
    ///
    /// # Shapes
    /// - h_split: `[n, hidden]` entering layer `split` → `[1, hidden]`
    fn exact_pass(
        &self,
        maps: &FillMaps,
        h_split: Tensor<2>,
        exact: &[usize],
        sink: usize,
        cache: &mut KvCache,
        oracle: Option<&Oracle>,
    ) -> Result<Tensor<2>> {
        let n = h_split.dims()[0];
        let layers = self.num_layers();
        let (kvh, hd) = (self.config.num_key_value_heads, self.config.head_dim());
        let kv2 = 2 * kvh * hd;
        let x_all = self.fill_features(h_split.clone());
        let rows_of = |t: Tensor<2>, pick: &[usize]| {
            let ids: Vec<i32> = pick.iter().map(|&p| p as i32).collect();
            t.select(
                0,
                Tensor::<1, Int>::from_data(TensorData::new(ids, [pick.len()]), &self.device),
            )
        };
        let mut h = rows_of(h_split, exact);
        // Exact rows past the sink (the fit never saw sink rows), as indices into `exact`.
        let first = exact.partition_point(|&p| p < sink);
        let update = match &maps.adapt {
            Some(a) if exact.len() > first && a.weight > 0.0 => {
                Some(self.adapt_factors(a, rows_of(x_all.clone(), &exact[first..]))?)
            }
            _ => None,
        };
        for l in maps.split..layers {
            let i = l - maps.split;
            let qkv = self.qkv(l, h.clone());
            let mut w = maps.w.clone().narrow(1, i * kv2, kv2);
            if let Some((xe, gain)) = &update {
                let k = exact.len() - first;
                let truth = qkv
                    .clone()
                    .narrow(1, self.config.q_dim(), kv2)
                    .narrow(0, first, k);
                let resid = truth - self.linear_dense(xe.clone(), &w);
                w = self.linear_dense_add(gain.clone(), &resid, w);
            }
            match self.layers[l].window.filter(|_| !maps.fill_unread) {
                Some(window) => {
                    // Only rows some exact row (or, past the tail, a decode step) can reach are
                    // ever read; the rest keep whatever the storage holds, masked out.
                    cache.reserve(l, n);
                    for r in window_reads(exact, window) {
                        let y = self.linear_dense(x_all.clone().narrow(0, r.start, r.len()), &w);
                        let (k, v) = self.split_fill(y, l, 1, r.len(), r.start);
                        cache.overwrite(l, r.start, k, v);
                    }
                }
                None => {
                    let y = self.linear_dense(x_all.clone(), &w);
                    self.append_fill(y, l, 1, cache, 0);
                }
            }
            if let Some(o) = oracle {
                o.restore(l, cache)?;
            }
            let (next, _) = self.block_qkv(l, h, qkv, cache, At::Rows(exact));
            h = next;
        }
        let m = exact.len();
        Ok(h.narrow(0, m - 1, 1))
    }

    /// `Xe` and the gain `P·(I/weight + Xe·P)⁻¹` with `P = G⁻¹·Xeᵀ`, for the exact rows'
    /// features `xe`: each layer's maps move by `gain · (truth − Xe·W)`.
    ///
    /// # Shapes
    /// - xe: `[k, hidden + 1]` → (`[k, hidden + 1]`, `[hidden + 1, k]`)
    fn adapt_factors(&self, a: &Adapt, xe: Tensor<2>) -> Result<(Tensor<2>, Tensor<2>)> {
        let k = xe.dims()[0];
        let p = a.precision.clone().matmul(xe.clone().transpose());
        let xp = crate::to_host_f32(xe.clone().matmul(p.clone()).cast(FloatDType::F32));
        let mut sys: Vec<f64> = xp.iter().map(|&v| f64::from(v)).collect();
        // Symmetrise: the device product is symmetric only up to rounding.
        for r in 0..k {
            for c in 0..r {
                let avg = 0.5 * (sys[r * k + c] + sys[c * k + r]);
                sys[r * k + c] = avg;
                sys[c * k + r] = avg;
            }
            sys[r * k + r] += 1.0 / a.weight;
        }
        let inv: Vec<f32> = spd_inverse(&sys, k)?
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let m = Tensor::<2>::from_data(TensorData::new(inv, [k, k]), &self.device).cast(self.dtype);
        Ok((xe, self.linear_dense(p, &m)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_grow_around_the_best_rows_within_the_budget() {
        let mut scores = vec![0.0f32; 100];
        scores[50] = 9.0;
        scores[52] = 8.0; // near the first: widens its span by two rows
        scores[90] = 7.0;
        scores[3] = 6.0; // its window is clipped to the bulk
        let spans = choose_spans(&scores, 1..96, 3 * 9, 4);
        assert_eq!(spans, vec![1..8, 46..57, 86..95]);
        // A window that would overrun the budget is passed over; smaller ones still fit.
        let spans = choose_spans(&scores, 1..96, 9 + 2, 4);
        assert_eq!(spans, vec![46..57]);
    }

    #[test]
    fn a_matched_sentence_is_covered_to_its_end() {
        // The query matches a sentence's first words best; the answer sits after them.
        let mut scores: Vec<f32> = (0..400).map(|i| ((i * 37 % 101) as f32) * 1e-3).collect();
        for (k, i) in (200..209).enumerate() {
            scores[i] = 1.0 - 0.05 * k as f32;
        }
        // A fixed ±8 window around row 200 would end at 208.
        let answer = 209..214;
        let spans = choose_spans(&scores, 1..384, 5 * 17, 8);
        assert!(
            answer.clone().all(|i| spans.iter().any(|s| s.contains(&i))),
            "{spans:?}"
        );
        let rows: usize = spans.iter().map(|s| s.len()).sum();
        assert!(rows <= 5 * 17, "{rows} rows");
    }

    #[test]
    fn a_sliding_layer_fills_only_rows_its_exact_rows_reach() {
        // Sink 0, a span 40..43, tail 96..100, window 8.
        let exact: Vec<usize> = [0].into_iter().chain(40..43).chain(96..100).collect();
        assert_eq!(window_reads(&exact, 8), vec![33..40, 89..96]);
        // A window wider than the prompt reaches every bulk row.
        assert_eq!(window_reads(&exact, 1000), vec![1..40, 43..96]);
        // Window 1: a row sees only itself, so nothing is filled.
        assert!(window_reads(&exact, 1).is_empty());
    }

    #[test]
    fn span_budget_counts_rows() {
        let rows = FillRows {
            exact: 0.05,
            ..FillRows::default()
        };
        assert_eq!(rows.span_count(2048), 6);
        assert_eq!(rows.exact_rows(2048), 6 * 17);
        assert_eq!(rows.span_count(4096), 12);
        assert_eq!(rows.span_count(512), MIN_SPANS);
        assert_eq!(rows.exact_rows(40), 40 - 17);
        assert_eq!(FillRows::default().span_count(2048), 0);
        assert_eq!(rows.bulk(17), None);
        assert_eq!(rows.bulk(18), Some(1..2));
    }

    #[test]
    fn spd_inverse_inverts() {
        let a = [4.0, 2.0, 0.6, 2.0, 5.0, 1.0, 0.6, 1.0, 3.0];
        let inv = spd_inverse(&a, 3).unwrap();
        for r in 0..3 {
            for c in 0..3 {
                let v: f64 = (0..3).map(|j| a[r * 3 + j] * inv[j * 3 + c]).sum();
                let want = if r == c { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-12, "({r},{c}) = {v}");
            }
        }
        assert!(spd_inverse(&[1.0, 2.0, 2.0, 1.0], 2).is_err());
    }
}
