//! The fill file: per-layer linear maps from the hidden state entering layer `split` to every
//! upper layer's K (before RoPE) and V, in a safetensors file. See `docs/fill-format.md`.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::error::{FieldMismatch, IoError, Result};

pub(crate) mod container;

use container::{OutData, OutTensor, Reader};

/// The fill-file layout version this code writes.
pub const FILL_FORMAT_VERSION: u32 = 2;
/// Versions this code reads: 1 has no `method`, `split_search` or `fill.precision`.
pub const FILL_FORMAT_VERSIONS_READ: &[u32] = &[1, 2];
/// Name of the optional `[d + 1, d + 1]` tensor `(XᵀX + λ·D)⁻¹` the per-prompt update needs.
pub const PRECISION_TENSOR: &str = "fill.precision";
/// Method names a fill file may record (see [`FillMethodMeta`]).
pub const METHOD_NAMES: &[&str] = &["ridge", "spans", "spans-adapt"];
/// Features the maps read: `[h / sqrt(mean(h²) + eps), 1]` (RMSNorm without its weight, plus a bias).
pub const FEATURE_KIND: &str = "rmsnorm_unweighted+bias";
/// Key in the safetensors `__metadata__` map holding the JSON metadata.
pub const METADATA_KEY: &str = "ridgefill";

/// What identifies the model a fill or statistics file was made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    /// HF `model_type`, e.g. "llama".
    pub architecture: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// [`Checkpoint::weights_fingerprint`]: a hash of tensor names, shapes, dtypes and bytes.
    pub weights_hash: String,
}

impl ModelFingerprint {
    /// The fingerprint of an opened checkpoint.
    pub fn of(ckpt: &Checkpoint) -> Self {
        let c = &ckpt.config;
        ModelFingerprint {
            architecture: c.model_type.clone(),
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            vocab_size: c.vocab_size,
            weights_hash: ckpt.weights_fingerprint(),
        }
    }

    /// Width of one layer's K (and V): kv heads × head dim (saturates rather than overflow).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads.saturating_mul(self.head_dim)
    }

    /// Every field where `self` (a file's) differs from `model` (the model in use).
    pub fn mismatches(&self, model: &ModelFingerprint) -> Vec<FieldMismatch> {
        let mut out = Vec::new();
        let mut cmp = |field: &'static str, file: &dyn Display, model: &dyn Display| {
            let (file, model) = (file.to_string(), model.to_string());
            if file != model {
                out.push(FieldMismatch { field, file, model });
            }
        };
        cmp("architecture", &self.architecture, &model.architecture);
        cmp("hidden_size", &self.hidden_size, &model.hidden_size);
        cmp(
            "num_hidden_layers",
            &self.num_hidden_layers,
            &model.num_hidden_layers,
        );
        cmp(
            "num_key_value_heads",
            &self.num_key_value_heads,
            &model.num_key_value_heads,
        );
        cmp("head_dim", &self.head_dim, &model.head_dim);
        cmp("vocab_size", &self.vocab_size, &model.vocab_size);
        cmp("weights_hash", &self.weights_hash, &model.weights_hash);
        out
    }

    /// Sizes every reader relies on: non-zero and small enough that products do not overflow.
    fn check_sizes(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, expected: &str, found: String| IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("{METADATA_KEY}.model.{field}"),
            expected: expected.to_string(),
            found,
        };
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(bad(field, "> 0", v.to_string()));
            }
        }
        let kv = self.num_key_value_heads.checked_mul(self.head_dim);
        let cols = kv
            .and_then(|kv| kv.checked_mul(2))
            .and_then(|c| c.checked_mul(self.num_hidden_layers));
        let feats = self.hidden_size.checked_add(1);
        if cols
            .zip(feats)
            .and_then(|(c, f)| c.checked_mul(f))
            .is_none()
        {
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key: format!("{METADATA_KEY}.model"),
                expected: "sizes whose products fit in memory addresses".into(),
                found: format!(
                    "num_key_value_heads {} x head_dim {} x num_hidden_layers {} x hidden_size {}",
                    self.num_key_value_heads,
                    self.head_dim,
                    self.num_hidden_layers,
                    self.hidden_size
                ),
            });
        }
        Ok(())
    }
}

/// How well the maps predict one layer on held-out text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerQuality {
    pub layer: usize,
    /// Coefficient of determination of K (pre-RoPE), pooled over all columns.
    pub r2_k: f64,
    /// Coefficient of determination of V, pooled over all columns.
    pub r2_v: f64,
}

/// One point of the ridge strength search.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AlphaTrial {
    /// Relative ridge strength.
    pub alpha: f64,
    /// The absolute ridge penalty it resolved to.
    pub lambda: f64,
    /// Mean held-out KL(full ‖ filled) of next-token distributions, in nats.
    pub kl: f64,
}

/// How the engine applies the maps by default; recorded by `fit`, overridable at run time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FillMethodMeta {
    /// One of [`METHOD_NAMES`]: plain ridge fill; plus query-chosen exact spans; plus the
    /// per-prompt map update from the exact rows.
    pub name: String,
    /// Share of the prompt's rows, beyond sink and tail, run exactly through the upper layers.
    pub exact: f64,
    /// Half-width in tokens of each exact span around a chosen position.
    pub span_radius: usize,
    /// Weight of one exact row against one calibration row in the per-prompt update.
    pub adapt_weight: f64,
}

impl Default for FillMethodMeta {
    /// What a version-1 file means: plain ridge.
    fn default() -> Self {
        Self {
            name: "ridge".into(),
            exact: 0.0,
            span_radius: 0,
            adapt_weight: 0.0,
        }
    }
}

/// One candidate of `fit --split auto`, measured on held-out text with the recorded method.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitTrial {
    pub split: usize,
    /// Mean held-out KL(full ‖ method), nats per token.
    pub kl: f64,
    /// Held-out top-1 agreement with full prefill.
    pub top1: f64,
    /// Prefill FLOPs against full prefill at the held-out prefix length.
    pub flops_ratio: f64,
}

/// The JSON stored under `__metadata__["ridgefill"]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FillMeta {
    pub format_version: u32,
    pub model: ModelFingerprint,
    /// First layer whose K/V are filled; layers `split..num_hidden_layers` have maps.
    pub split: usize,
    /// Leading tokens of every prompt computed exactly (and excluded from calibration).
    pub sink: usize,
    /// Must be [`FEATURE_KIND`].
    pub feature: String,
    /// Chosen relative ridge strength.
    pub alpha: f64,
    /// Absolute ridge penalty added to the diagonal of XᵀX (bias row excluded).
    pub lambda: f64,
    /// Rows (tokens) the maps were fitted on.
    pub calib_tokens: u64,
    pub calib_sources: Vec<String>,
    /// Rows used for the quality numbers.
    pub heldout_tokens: u64,
    pub quality: Vec<LayerQuality>,
    /// Mean held-out KL(full ‖ filled) in nats at the chosen alpha, when measured.
    pub heldout_kl: Option<f64>,
    pub alpha_grid: Vec<AlphaTrial>,
    /// Program and version that wrote the file.
    pub created_by: String,
    /// The method and budget the maps were made for (format 2; version 1 files mean ridge).
    #[serde(default)]
    pub method: FillMethodMeta,
    /// Every candidate `fit --split auto` measured (empty for a fixed split).
    #[serde(default)]
    pub split_search: Vec<SplitTrial>,
}

impl FillMeta {
    /// The maps' held-out error: `1 − R²` of K and V averaged over the upper layers, the
    /// calibration text's counterpart of a prompt's self-check error (`None`: not measured).
    pub fn heldout_error(&self) -> Option<f64> {
        let n = self.quality.len();
        let sum: f64 = self
            .quality
            .iter()
            .map(|q| 1.0 - 0.5 * (q.r2_k + q.r2_v))
            .sum();
        (n > 0 && sum.is_finite()).then(|| sum / n as f64)
    }

    /// The first float field JSON cannot hold (NaN or infinity), with its dotted name.
    fn first_non_finite(&self) -> Option<(String, f64)> {
        let mut fields = vec![
            ("alpha".to_string(), self.alpha),
            ("lambda".into(), self.lambda),
        ];
        fields.extend(self.heldout_kl.map(|kl| ("heldout_kl".into(), kl)));
        for (i, q) in self.quality.iter().enumerate() {
            fields.push((format!("quality[{i}].r2_k"), q.r2_k));
            fields.push((format!("quality[{i}].r2_v"), q.r2_v));
        }
        for (i, t) in self.alpha_grid.iter().enumerate() {
            fields.push((format!("alpha_grid[{i}].alpha"), t.alpha));
            fields.push((format!("alpha_grid[{i}].lambda"), t.lambda));
            fields.push((format!("alpha_grid[{i}].kl"), t.kl));
        }
        fields.push(("method.exact".into(), self.method.exact));
        fields.push(("method.adapt_weight".into(), self.method.adapt_weight));
        for (i, t) in self.split_search.iter().enumerate() {
            fields.push((format!("split_search[{i}].kl"), t.kl));
            fields.push((format!("split_search[{i}].top1"), t.top1));
            fields.push((format!("split_search[{i}].flops_ratio"), t.flops_ratio));
        }
        fields.into_iter().find(|(_, v)| !v.is_finite())
    }
}

/// Storage precision of the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillDtype {
    F32,
    F16,
}

/// A fill file in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct FillFile {
    pub meta: FillMeta,
    /// `k[i]` maps to layer `split + i`'s K: row-major `[hidden + 1, kv_dim]`.
    pub k: Vec<Vec<f32>>,
    /// `v[i]` maps to layer `split + i`'s V: row-major `[hidden + 1, kv_dim]`.
    pub v: Vec<Vec<f32>>,
    /// `(XᵀX + λ·D)⁻¹`, row-major `[hidden + 1, hidden + 1]`: lets the engine update the maps
    /// per prompt from its exactly computed rows (method `spans-adapt`).
    pub precision: Option<Vec<f32>>,
}

/// Name of the K map tensor of `layer`.
pub fn k_tensor_name(layer: usize) -> String {
    format!("fill.{layer}.k")
}

/// Name of the V map tensor of `layer`.
pub fn v_tensor_name(layer: usize) -> String {
    format!("fill.{layer}.v")
}

/// The layer a tensor name `fill.{layer}.{k|v}` refers to, when it is spelt canonically.
fn parse_tensor_name(name: &str) -> Option<usize> {
    let layer: usize = name
        .strip_prefix("fill.")?
        .split('.')
        .next()?
        .parse()
        .ok()?;
    (name == k_tensor_name(layer) || name == v_tensor_name(layer)).then_some(layer)
}

/// Checks the metadata fields both file kinds share.
pub(crate) fn check_common_meta(
    path: &Path,
    model: &ModelFingerprint,
    split: usize,
    feature: &str,
) -> Result<()> {
    if feature != FEATURE_KIND {
        return Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("{METADATA_KEY}.feature"),
            expected: format!("{FEATURE_KIND:?}"),
            found: format!("{feature:?}"),
        });
    }
    model.check_sizes(path)?;
    let layers = model.num_hidden_layers;
    if split == 0 || split >= layers {
        return Err(IoError::BadMetadata {
            path: path.to_path_buf(),
            key: format!("{METADATA_KEY}.split"),
            expected: format!("0 < split < num_hidden_layers {layers}"),
            found: split.to_string(),
        });
    }
    Ok(())
}

/// Checks the recorded method: a known name, a budget in `0..=1`, and what the method needs.
fn check_method(path: &Path, m: &FillMethodMeta, has_precision: bool) -> Result<()> {
    let bad = |field: &str, expected: &str, found: String| IoError::BadMetadata {
        path: path.to_path_buf(),
        key: format!("{METADATA_KEY}.method.{field}"),
        expected: expected.to_string(),
        found,
    };
    if !METHOD_NAMES.contains(&m.name.as_str()) {
        return Err(bad(
            "name",
            &format!("one of {METHOD_NAMES:?}"),
            format!("{:?}", m.name),
        ));
    }
    if !(0.0..=1.0).contains(&m.exact) {
        return Err(bad("exact", "a share between 0 and 1", m.exact.to_string()));
    }
    if !(m.adapt_weight >= 0.0 && m.adapt_weight.is_finite()) {
        return Err(bad(
            "adapt_weight",
            "a finite number ≥ 0",
            m.adapt_weight.to_string(),
        ));
    }
    if m.name == "spans-adapt" && !has_precision {
        return Err(IoError::MissingTensor {
            path: path.to_path_buf(),
            tensor: PRECISION_TENSOR.into(),
        });
    }
    Ok(())
}

impl FillFile {
    /// Reads and fully validates a fill file (F32 or F16 maps come back as f32).
    pub fn read(path: &Path) -> Result<Self> {
        Self::from_reader(path, Reader::open(path)?)
    }

    /// Like [`FillFile::read`] for a file image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::from_reader(path, Reader::from_bytes(path, bytes)?)
    }

    fn from_reader(path: &Path, r: Reader) -> Result<Self> {
        let json = r.metadata_json(METADATA_KEY)?;
        let version =
            container::check_versions(path, METADATA_KEY, &json, FILL_FORMAT_VERSIONS_READ)?;
        let meta: FillMeta = container::parse_meta(
            path,
            METADATA_KEY,
            json,
            "fill metadata (docs/fill-format.md)",
        )?;
        check_common_meta(path, &meta.model, meta.split, &meta.feature)?;
        let (split, layers) = (meta.split, meta.model.num_hidden_layers);
        let expected_names = || {
            let extra = if version >= 2 {
                format!(" (and optionally {PRECISION_TENSOR})")
            } else {
                String::new()
            };
            format!("fill.{{l}}.k and fill.{{l}}.v for l in {split}..{layers}{extra}")
        };
        let present = r.tensors();
        for name in present.keys() {
            let precision = version >= 2 && name == PRECISION_TENSOR;
            if !precision && !parse_tensor_name(name).is_some_and(|l| (split..layers).contains(&l))
            {
                return Err(IoError::UnexpectedTensor {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    expected: expected_names(),
                });
            }
        }
        // Every present name is a distinct valid one, so the first missing is found within
        // (tensors in the file)/2 + 1 layers however large num_hidden_layers claims to be.
        let names: BTreeSet<&String> = present.keys().collect();
        let features = meta.model.hidden_size + 1;
        let precision = if present.contains_key(PRECISION_TENSOR) {
            Some(r.f32_values(PRECISION_TENSOR, &[features, features])?)
        } else {
            None
        };
        check_method(path, &meta.method, precision.is_some())?;
        let shape = [meta.model.hidden_size + 1, meta.model.kv_dim()];
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for layer in split..layers {
            for (name, out) in [
                (k_tensor_name(layer), &mut k),
                (v_tensor_name(layer), &mut v),
            ] {
                if !names.contains(&name) {
                    return Err(IoError::MissingTensor {
                        path: path.to_path_buf(),
                        tensor: name,
                    });
                }
                out.push(r.f32_values(&name, &shape)?);
            }
        }
        Ok(FillFile {
            meta,
            k,
            v,
            precision,
        })
    }

    /// Writes atomically (temporary file in the same directory, fsync, rename), refusing
    /// anything [`FillFile::read`] would reject.
    pub fn write(&self, path: &Path, dtype: FillDtype) -> Result<()> {
        let meta = &self.meta;
        if meta.format_version != FILL_FORMAT_VERSION {
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key: format!("{METADATA_KEY}.format_version"),
                expected: FILL_FORMAT_VERSION.to_string(),
                found: meta.format_version.to_string(),
            });
        }
        check_common_meta(path, &meta.model, meta.split, &meta.feature)?;
        check_method(path, &meta.method, self.precision.is_some())?;
        if let Some((field, value)) = meta.first_non_finite() {
            // JSON has no NaN or infinity: serde_json would write null, which does not read back.
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key: format!("{METADATA_KEY}.{field}"),
                expected: "a finite number".into(),
                found: value.to_string(),
            });
        }
        let upper = meta.model.num_hidden_layers - meta.split;
        for (what, maps) in [("K", &self.k), ("V", &self.v)] {
            if maps.len() != upper {
                return Err(IoError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: format!("fill.*.{}", what.to_lowercase()),
                    what: format!("number of {what} maps"),
                    expected: format!(
                        "{upper} (layers {}..{})",
                        meta.split, meta.model.num_hidden_layers
                    ),
                    found: maps.len().to_string(),
                });
            }
        }
        let json = serde_json::to_string(meta).map_err(|e| IoError::Json {
            path: path.to_path_buf(),
            source: e,
        })?;
        let shape = vec![meta.model.hidden_size + 1, meta.model.kv_dim()];
        let mut tensors = Vec::with_capacity(2 * upper);
        for (i, (km, vm)) in self.k.iter().zip(&self.v).enumerate() {
            let layer = meta.split + i;
            for (name, m) in [(k_tensor_name(layer), km), (v_tensor_name(layer), vm)] {
                tensors.push(OutTensor {
                    name,
                    shape: shape.clone(),
                    data: match dtype {
                        FillDtype::F32 => OutData::F32(m),
                        FillDtype::F16 => OutData::F16(m),
                    },
                });
            }
        }
        let features = meta.model.hidden_size + 1;
        if let Some(p) = &self.precision {
            if p.len() != features * features {
                return Err(IoError::BadTensor {
                    path: path.to_path_buf(),
                    tensor: PRECISION_TENSOR.into(),
                    what: "number of values".into(),
                    expected: format!("{features}×{features}"),
                    found: p.len().to_string(),
                });
            }
            // Always f32: the update multiplies by it, and f16 would lose its small entries.
            tensors.push(OutTensor {
                name: PRECISION_TENSOR.into(),
                shape: vec![features, features],
                data: OutData::F32(p),
            });
        }
        container::write_atomic(path, METADATA_KEY, json, &tensors)
    }

    /// Errors, naming every differing field, unless this file was made for the model `fp`.
    pub fn check_model(&self, path: &Path, fp: &ModelFingerprint) -> Result<()> {
        let fields = self.meta.model.mismatches(fp);
        if fields.is_empty() {
            return Ok(());
        }
        Err(IoError::ModelMismatch {
            path: path.to_path_buf(),
            what: "fill file",
            fields,
        })
    }
}
