//! Loading a fill file for a model: every mismatch is an error before anything runs.

use std::path::Path;

use anyhow::Result;
use ridgefill_io::IoError;
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::fill::{
    FillFile, METADATA_KEY, ModelFingerprint, PRECISION_TENSOR, k_tensor_name, v_tensor_name,
};
use ridgefill_model::Decoder;
use ridgefill_model::fill::{
    DEFAULT_ADAPT_WEIGHT, DEFAULT_ERROR_RATIO, DEFAULT_EXACT, DEFAULT_SPAN_ERROR_RATIO,
    DEFAULT_SPAN_RADIUS, FillMaps, FillMethod, FillRows,
};

/// Reads `path`, checks it was made for this model and holds only finite numbers, and uploads
/// the maps to the model's device.
pub fn load_maps(path: &Path, ckpt: &Checkpoint, model: &Decoder) -> Result<(FillFile, FillMaps)> {
    let file = FillFile::read(path)?;
    file.check_model(path, &ModelFingerprint::of(ckpt))?;
    let layers = model.num_layers();
    if file.meta.split == 0 || file.meta.split >= layers {
        return Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("{METADATA_KEY}.split"),
            expected: format!("0 < split < {layers} (this model's layers)"),
            found: file.meta.split.to_string(),
        }
        .into());
    }
    for (i, (k, v)) in file.k.iter().zip(&file.v).enumerate() {
        let layer = file.meta.split + i;
        for (tensor, m) in [(k_tensor_name(layer), k), (v_tensor_name(layer), v)] {
            if let Some(index) = m.iter().position(|x| !x.is_finite()) {
                return Err(IoError::NonFinite {
                    path: path.to_path_buf(),
                    tensor,
                    index,
                    value: f64::from(m[index]),
                }
                .into());
            }
        }
    }
    if let Some(index) = file
        .precision
        .as_ref()
        .and_then(|p| p.iter().position(|x| !x.is_finite()))
    {
        return Err(IoError::NonFinite {
            path: path.to_path_buf(),
            tensor: PRECISION_TENSOR.into(),
            index,
            value: f64::from(file.precision.as_ref().map_or(0.0, |p| p[index])),
        }
        .into());
    }
    let mut maps = FillMaps::from_host(
        file.meta.split,
        model.config.hidden_size,
        model.config.kv_dim(),
        &file.k,
        &file.v,
        model.dtype,
        &model.device,
    )?;
    if let Some(p) = &file.precision {
        let weight = match file.meta.method.adapt_weight {
            w if w > 0.0 => w,
            _ => DEFAULT_ADAPT_WEIGHT,
        };
        maps = maps.with_adapt(p, weight, model.dtype, &model.device)?;
    }
    let tok = &ckpt.tokenizer;
    let maps = maps
        .with_breaks(line_breaks(tok))
        .with_stops(sentence_stops(tok));
    Ok((file, maps))
}

/// The ids of every token whose text holds a line break: where a prompt's final question can
/// start ([`FillRows::for_prompt`]).
pub fn line_breaks(tok: &ridgefill_io::tokenizer::Tokenizer) -> Vec<u32> {
    (0..tok.vocab_size() as u32)
        .filter(|&id| tok.decode(&[id], false).is_ok_and(|t| t.contains('\n')))
        .collect()
}

/// The ids (increasing) of every token that ends a sentence (its text, trimmed, ends in `.`, `!`
/// or `?`) or holds a line break: where a chosen exact span may run on to ([`choose_spans`]).
///
/// [`choose_spans`]: ridgefill_model::fill::choose_spans
pub fn sentence_stops(tok: &ridgefill_io::tokenizer::Tokenizer) -> Vec<u32> {
    (0..tok.vocab_size() as u32)
        .filter(|&id| {
            tok.decode(&[id], false)
                .is_ok_and(|t| t.contains('\n') || t.trim_end().ends_with(['.', '!', '?']))
        })
        .collect()
}

/// [`load_maps`] then [`configure`]: the fill file at `path` ready to run as `choice` says.
pub fn load_configured(
    path: &Path,
    ckpt: &Checkpoint,
    model: &Decoder,
    choice: &MethodChoice,
) -> Result<(FillMethod, FillMaps, FillRows)> {
    let (file, maps) = load_ladder(path, &choice.deeper, ckpt, model)?;
    configure(&file, &maps, choice)
}

/// [`load_maps`] of `path`, with the fill files at deeper splits in `deeper` (increasing
/// splits) chained behind it: each is tried in turn when the one before fails its self-check.
pub fn load_ladder(
    path: &Path,
    deeper: &[std::path::PathBuf],
    ckpt: &Checkpoint,
    model: &Decoder,
) -> Result<(FillFile, FillMaps)> {
    let (file, maps) = load_maps(path, ckpt, model)?;
    let mut chain = Vec::with_capacity(deeper.len());
    for p in deeper {
        chain.push((p, load_maps(p, ckpt, model)?.1));
    }
    // Chained from the deepest up, each behind the next shallower one.
    let mut next: Option<FillMaps> = None;
    for (p, m) in chain.into_iter().rev() {
        let m = match next.take() {
            Some(d) => m.with_deeper(d),
            None => Ok(m),
        };
        next = Some(m.map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?);
    }
    let maps = match next {
        Some(d) => maps
            .with_deeper(d)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        None => maps,
    };
    Ok((file, maps))
}

/// The method and rows a run uses: each run-time choice, else what the fill file records.
pub fn configure(
    file: &FillFile,
    maps: &FillMaps,
    choice: &MethodChoice,
) -> Result<(FillMethod, FillMaps, FillRows)> {
    let recorded = &file.meta.method;
    let method = match choice.method {
        Some(m) => m,
        None => FillMethod::parse(&recorded.name).unwrap_or(FillMethod::Ridge),
    };
    let exact = choice.exact.unwrap_or(match recorded.exact {
        e if e > 0.0 => e,
        _ => DEFAULT_EXACT,
    });
    let span = choice.span.unwrap_or(match recorded.span_radius {
        0 => DEFAULT_SPAN_RADIUS,
        r => r,
    });
    let own_method = choice.method.is_none_or(|m| m.name() == recorded.name);
    let rows = FillRows {
        sink: choice.sink,
        tail: choice.tail,
        exact,
        span,
        question: choice.question,
        sentence_reach: choice.sentence_reach,
        max_error: match choice.max_error {
            Some(e) => e,
            // The self-check guards the method the file was fitted for, not a variant of it.
            None if own_method => default_max_error(&file.meta, DEFAULT_ERROR_RATIO),
            None => f64::INFINITY,
        },
        max_span_error: match (choice.max_span_error, choice.max_error) {
            (Some(e), _) => e,
            // `--max-fill-error off` turns the whole self-check off.
            (None, Some(e)) if e.is_infinite() => f64::INFINITY,
            (None, _) if own_method => default_max_error(&file.meta, DEFAULT_SPAN_ERROR_RATIO),
            (None, _) => f64::INFINITY,
        },
        retry_exact: choice.retry_exact,
        min_coverage: choice.min_coverage,
        resume_spans: choice.resume_spans,
        resume_min_attention: choice.resume_min_attention,
        resume_layers: choice.resume_layers,
        decode_every: choice.decode_every,
        decode_spans: choice.decode_spans,
    };
    let (mut maps, rows) = method.configure(maps, rows)?;
    if let (Some(w), Some(a)) = (choice.adapt_weight, maps.adapt.as_mut()) {
        a.weight = w;
    }
    Ok((method, maps, rows))
}

/// A self-check threshold a fill file runs with unless told otherwise: `ratio` times its maps'
/// held-out error ([`DEFAULT_ERROR_RATIO`] over every exact row, [`DEFAULT_SPAN_ERROR_RATIO`]
/// over the spans; none for a file without one).
pub fn default_max_error(meta: &ridgefill_io::fill::FillMeta, ratio: f64) -> f64 {
    meta.heldout_error().map_or(f64::INFINITY, |e| ratio * e)
}

/// Run-time choices of how to apply a fill file (`None`: what the file records).
#[derive(Clone, Debug)]
pub struct MethodChoice {
    pub method: Option<FillMethod>,
    pub exact: Option<f64>,
    pub span: Option<usize>,
    pub adapt_weight: Option<f64>,
    pub sink: usize,
    pub tail: usize,
    /// Longest tail grown back to the final question (0: fixed tail).
    pub question: usize,
    /// How far, in span radii, a span may run on to its sentence's end (0: fixed width).
    pub sentence_reach: usize,
    /// Self-check threshold on the maps' relative error (`None`: the file's default for its
    /// own method, [`default_max_error`]; infinite: never fall back).
    pub max_error: Option<f64>,
    /// Threshold of the self-check's reading over the spans alone (`None`: the file's default,
    /// or off with `max_error` infinite).
    pub max_span_error: Option<f64>,
    /// Share of rows exact in a second fill after a failed self-check (0: every layer exactly).
    pub retry_exact: f64,
    /// Coverage check: the least share of the question's attention to filled rows the spans
    /// must take (0: never checked).
    pub min_coverage: f64,
    /// Spans a follow-up over a cached prefix restores among earlier filled rows.
    pub resume_spans: usize,
    /// The least share of a follow-up's attention on filled rows for which it restores spans.
    pub resume_min_attention: f64,
    /// Upper layers a follow-up's restored rows run (`None`: every one).
    pub resume_layers: Option<usize>,
    /// Generated tokens between restores while decoding over a filled cache (0: none).
    pub decode_every: usize,
    /// Spans each restore runs exactly.
    pub decode_spans: usize,
    /// Fill files at deeper splits, tried in turn when the self-check fails.
    pub deeper: Vec<std::path::PathBuf>,
}
