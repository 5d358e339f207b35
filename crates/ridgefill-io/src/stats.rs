//! Sufficient statistics for the ridge fit, in f64, so calibration can be sharded across
//! machines and merged by summing. See `docs/fill-format.md`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{IoError, Result};
use crate::fill::container::{self, OutData, OutTensor, Reader};
use crate::fill::{METADATA_KEY, ModelFingerprint, check_common_meta};

/// The statistics-file layout version this code reads and writes.
pub const STATS_FORMAT_VERSION: u32 = 1;
/// Tensor-name prefix of the statistics the maps are fitted on.
pub const FIT_PREFIX: &str = "fit";
/// Tensor-name prefix of the held-out statistics used for quality numbers.
pub const HELDOUT_PREFIX: &str = "heldout";
/// Per-set tensor suffixes, in file order.
const SUFFIXES: [&str; 5] = ["xtx", "xty", "y_sum", "y_sq", "rows"];

/// The JSON stored under `__metadata__["ridgefill"]` of a statistics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsMeta {
    pub format_version: u32,
    pub model: ModelFingerprint,
    /// Layer whose input hidden state the features come from.
    pub split: usize,
    /// Leading tokens of every calibration window left out of the statistics.
    pub sink: usize,
    /// Must be [`crate::fill::FEATURE_KIND`].
    pub feature: String,
    /// Calibration window length in tokens.
    pub ctx: usize,
    /// Where the calibration text came from (documents, files, data sets).
    pub sources: Vec<String>,
}

impl StatsMeta {
    /// Target columns: per upper layer, kv_dim K columns then kv_dim V columns.
    /// Saturates on inconsistent metadata instead of panicking; [`StatsFile::read`] rejects it.
    pub fn cols(&self) -> usize {
        self.model
            .num_hidden_layers
            .saturating_sub(self.split)
            .saturating_mul(2)
            .saturating_mul(self.model.kv_dim())
    }

    /// Feature count: hidden size plus the constant 1.
    pub fn features(&self) -> usize {
        self.model.hidden_size.saturating_add(1)
    }
}

/// One set of statistics over rows x (`features` wide) and targets y (`cols` wide).
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    /// Rows (tokens) summed.
    pub rows: u64,
    /// Σ xᵀx, row-major `[features, features]`.
    pub xtx: Vec<f64>,
    /// Σ xᵀy, row-major `[features, cols]`.
    pub xty: Vec<f64>,
    /// Σ y per column.
    pub y_sum: Vec<f64>,
    /// Σ y² per column.
    pub y_sq: Vec<f64>,
}

impl Moments {
    /// Empty statistics of the given shape.
    pub fn zeros(features: usize, cols: usize) -> Self {
        Moments {
            rows: 0,
            xtx: vec![0.0; features * features],
            xty: vec![0.0; features * cols],
            y_sum: vec![0.0; cols],
            y_sq: vec![0.0; cols],
        }
    }

    /// Adds `other` in place; errors (changing nothing) when the shapes differ.
    pub fn add(&mut self, other: &Moments) -> std::result::Result<(), String> {
        for (what, a, b) in [
            ("xtx", self.xtx.len(), other.xtx.len()),
            ("xty", self.xty.len(), other.xty.len()),
            ("y_sum", self.y_sum.len(), other.y_sum.len()),
            ("y_sq", self.y_sq.len(), other.y_sq.len()),
        ] {
            if a != b {
                return Err(format!("{what} length: expected {a}, found {b}"));
            }
        }
        let rows = self
            .rows
            .checked_add(other.rows)
            .ok_or_else(|| format!("rows: {} + {} overflows u64", self.rows, other.rows))?;
        self.rows = rows;
        for (a, b) in [
            (&mut self.xtx, &other.xtx),
            (&mut self.xty, &other.xty),
            (&mut self.y_sum, &other.y_sum),
            (&mut self.y_sq, &other.y_sq),
        ] {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    /// Feature count (`xtx` is square).
    pub fn features(&self) -> usize {
        self.xtx.len().isqrt()
    }

    /// Target column count.
    pub fn cols(&self) -> usize {
        self.y_sum.len()
    }
}

/// A statistics file in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct StatsFile {
    pub meta: StatsMeta,
    /// Statistics the maps are fitted on.
    pub fit: Moments,
    /// Statistics of held-out text, for quality numbers (may have zero rows).
    pub heldout: Moments,
}

fn tensor_name(prefix: &str, suffix: &str) -> String {
    format!("{prefix}.{suffix}")
}

impl StatsFile {
    /// Reads and fully validates a statistics file.
    pub fn read(path: &Path) -> Result<Self> {
        Self::from_reader(path, Reader::open(path)?)
    }

    /// Like [`StatsFile::read`] for a file image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::from_reader(path, Reader::from_bytes(path, bytes)?)
    }

    fn from_reader(path: &Path, r: Reader) -> Result<Self> {
        let json = r.metadata_json(METADATA_KEY)?;
        container::check_version(path, METADATA_KEY, &json, STATS_FORMAT_VERSION)?;
        let meta: StatsMeta = container::parse_meta(
            path,
            METADATA_KEY,
            json,
            "statistics metadata (docs/fill-format.md)",
        )?;
        check_common_meta(path, &meta.model, meta.split, &meta.feature)?;
        let expected: Vec<String> = [FIT_PREFIX, HELDOUT_PREFIX]
            .iter()
            .flat_map(|p| SUFFIXES.iter().map(move |s| tensor_name(p, s)))
            .collect();
        if let Some(name) = r.tensors().keys().find(|n| !expected.contains(n)) {
            return Err(IoError::UnexpectedTensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                expected: expected.join(", "),
            });
        }
        let fit = read_moments(&r, FIT_PREFIX, &meta)?;
        let heldout = read_moments(&r, HELDOUT_PREFIX, &meta)?;
        Ok(StatsFile { meta, fit, heldout })
    }

    /// Writes atomically (temporary file in the same directory, fsync, rename), refusing
    /// anything [`StatsFile::read`] would reject. Row counts are stored as I64.
    pub fn write(&self, path: &Path) -> Result<()> {
        let meta = &self.meta;
        if meta.format_version != STATS_FORMAT_VERSION {
            return Err(IoError::BadMetadata {
                path: path.to_path_buf(),
                key: format!("{METADATA_KEY}.format_version"),
                expected: STATS_FORMAT_VERSION.to_string(),
                found: meta.format_version.to_string(),
            });
        }
        check_common_meta(path, &meta.model, meta.split, &meta.feature)?;
        let json = serde_json::to_string(meta).map_err(|e| IoError::Json {
            path: path.to_path_buf(),
            source: e,
        })?;
        let rows = |prefix: &str, m: &Moments| {
            i64::try_from(m.rows).map_err(|_| IoError::BadTensor {
                path: path.to_path_buf(),
                tensor: tensor_name(prefix, "rows"),
                what: "value".into(),
                expected: format!("at most {}", i64::MAX),
                found: m.rows.to_string(),
            })
        };
        let rows_fit = [rows(FIT_PREFIX, &self.fit)?];
        let rows_heldout = [rows(HELDOUT_PREFIX, &self.heldout)?];
        let (f, c) = (meta.features(), meta.cols());
        let mut tensors = Vec::new();
        for (prefix, m, rows) in [
            (FIT_PREFIX, &self.fit, &rows_fit),
            (HELDOUT_PREFIX, &self.heldout, &rows_heldout),
        ] {
            let t = |suffix: &str, shape: Vec<usize>, data| OutTensor {
                name: tensor_name(prefix, suffix),
                shape,
                data,
            };
            tensors.push(t("xtx", vec![f, f], OutData::F64(&m.xtx)));
            tensors.push(t("xty", vec![f, c], OutData::F64(&m.xty)));
            tensors.push(t("y_sum", vec![c], OutData::F64(&m.y_sum)));
            tensors.push(t("y_sq", vec![c], OutData::F64(&m.y_sq)));
            tensors.push(t("rows", vec![1], OutData::I64(rows)));
        }
        container::write_atomic(path, METADATA_KEY, json, &tensors)
    }

    /// Sums shards; errors, naming both files, if the model, split, sink, feature or ctx differ.
    /// Sources are concatenated in the order given.
    pub fn merge(paths: &[PathBuf]) -> Result<StatsFile> {
        let Some((first, rest)) = paths.split_first() else {
            return Err(IoError::MissingFile {
                path: PathBuf::new(),
                what: "statistics shards to merge (none given)".into(),
            });
        };
        let mut out = StatsFile::read(first)?;
        for path in rest {
            let shard = StatsFile::read(path)?;
            let mismatch =
                |field: &str, value: String, other_value: String| IoError::ShardMismatch {
                    path: path.clone(),
                    other: first.clone(),
                    field: field.to_string(),
                    value,
                    other_value,
                };
            if let Some(m) = shard
                .meta
                .model
                .mismatches(&out.meta.model)
                .into_iter()
                .next()
            {
                return Err(mismatch(&format!("model.{}", m.field), m.file, m.model));
            }
            let (a, b) = (&shard.meta, &out.meta);
            for (field, value, other) in [
                ("split", a.split, b.split),
                ("sink", a.sink, b.sink),
                ("ctx", a.ctx, b.ctx),
            ] {
                if value != other {
                    return Err(mismatch(field, value.to_string(), other.to_string()));
                }
            }
            if a.feature != b.feature {
                return Err(mismatch("feature", a.feature.clone(), b.feature.clone()));
            }
            for (prefix, sum, part) in [
                (FIT_PREFIX, &mut out.fit, &shard.fit),
                (HELDOUT_PREFIX, &mut out.heldout, &shard.heldout),
            ] {
                sum.add(part).map_err(|e| IoError::BadTensor {
                    path: path.clone(),
                    tensor: format!("{prefix}.*"),
                    what: format!("sum with {}", first.display()),
                    expected: "shapes and row counts that add".into(),
                    found: e,
                })?;
            }
            out.meta.sources.extend(shard.meta.sources);
        }
        Ok(out)
    }
}

/// Reads one set's five tensors, shapes checked against the metadata.
fn read_moments(r: &Reader, prefix: &str, meta: &StatsMeta) -> Result<Moments> {
    let (f, c) = (meta.features(), meta.cols());
    let name = |s| tensor_name(prefix, s);
    Ok(Moments {
        xtx: r.f64_values(&name("xtx"), &[f, f])?,
        xty: r.f64_values(&name("xty"), &[f, c])?,
        y_sum: r.f64_values(&name("y_sum"), &[c])?,
        y_sq: r.f64_values(&name("y_sq"), &[c])?,
        rows: r.count(&name("rows"))?,
    })
}
