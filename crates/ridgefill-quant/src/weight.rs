//! [`QMatrix`] (one weight in its GGUF block format) and [`QWeight`] (several stacked along the
//! output rows), with the matmul driver: activation quantisation, row chunks over the pool, and
//! the dequantise-then-f32-GEMM path for large batches.

use std::cell::RefCell;
use std::sync::Arc;

use ridgefill_io::{GgmlType, GgufFile};

use crate::act::{Q8Buf, Q8KBuf, Q8Row};
use crate::bytes::WeightBytes;
use crate::kernels::{
    ActKind, XRow, act_kind, gemv_lanes, gemv_rows, gemv_rows_multi, lanes_level,
};
use crate::lanes;
use crate::pool::Pool;
use crate::simd::SimdLevel;
use crate::small_gemm::{SMALL_M_MAX, dot_tiles};

/// Errors of building a weight or calling a matmul with inconsistent sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QError {
    /// No kernel for this type.
    #[error(
        "{0} weights have no matmul kernel: expected one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32"
    )]
    Unsupported(GgmlType),
    /// A row is not a whole number of blocks.
    #[error("{ty}: rows of {cols} values are not a multiple of the block size {block}")]
    NotBlockMultiple {
        ty: GgmlType,
        cols: usize,
        block: usize,
    },
    /// The byte count does not match the shape.
    #[error("{ty} [{rows}, {cols}] needs {expected} bytes, found {found}")]
    ByteLength {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        found: usize,
    },
    /// A matrix with no rows or no columns.
    #[error("empty weight matrix [{rows}, {cols}]")]
    Empty { rows: usize, cols: usize },
    /// Stacked parts must share the input width.
    #[error("stacked parts must have equal columns: part 0 has {first}, part {index} has {found}")]
    ColsMismatch {
        first: usize,
        index: usize,
        found: usize,
    },
    /// [`QWeight::new`] needs at least one part.
    #[error("a stacked weight needs at least one part")]
    NoParts,
    /// A GGUF tensor that is missing or is not a 2-D matrix.
    #[error("GGUF tensor {name}: {reason}")]
    Tensor { name: String, reason: String },
    /// A matmul operand of the wrong length.
    #[error("matmul: {what} has {found} values, expected {m} × {width} = {}", m * width)]
    OperandLength {
        what: &'static str,
        found: usize,
        m: usize,
        width: usize,
    },
    /// A row range outside the matrix.
    #[error("rows {start}..{end} are outside a weight of {rows} rows")]
    RowRange {
        start: usize,
        end: usize,
        rows: usize,
    },
}

/// One weight `[rows = out features, cols = in features]` in a GGUF storage type, holding its
/// bytes exactly as in the file (`rows` rows, each `cols / block` blocks), or after
/// [`QMatrix::prepared_for`] possibly rearranged into the row-lane layout its kernels read.
#[derive(Clone, Debug)]
pub struct QMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: WeightBytes,
    /// In the row-lane layout ([`crate::lanes`]) rather than row after row.
    row_lanes: bool,
}

impl QMatrix {
    /// Wraps `data` after checking the type has a kernel and the sizes agree.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: WeightBytes) -> Result<Self, QError> {
        if act_kind(ty).is_none() {
            return Err(QError::Unsupported(ty));
        }
        if rows == 0 || cols == 0 {
            return Err(QError::Empty { rows, cols });
        }
        let block = ty.block_size();
        if !cols.is_multiple_of(block) {
            return Err(QError::NotBlockMultiple { ty, cols, block });
        }
        let row_bytes = cols / block * ty.type_size();
        let expected = row_bytes.checked_mul(rows);
        if expected != Some(data.len()) {
            return Err(QError::ByteLength {
                ty,
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                found: data.len(),
            });
        }
        Ok(QMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            data,
            row_lanes: false,
        })
    }

    /// This matrix in the layout the kernels of `level` read fastest: with AVX-512 VNNI or
    /// AVX-VNNI, Q4_0, Q4_1 and Q8_0 (rows a multiple of 16) are copied once into the row-lane
    /// layout ([`crate::lanes`]); anything else, or a level this CPU lacks, is returned as it is.
    ///
    /// Rearranged weights always run row-lane kernels, whatever level a call asks for: AVX-VNNI's
    /// when the call asks for that level, else AVX-512 VNNI's where the CPU has it.
    pub fn prepared_for(self, level: SimdLevel) -> QMatrix {
        if self.row_lanes || !level.is_available() || !lanes::applies(level, self.ty, self.rows) {
            return self;
        }
        let data = WeightBytes::from_vec(lanes::pack(self.ty, &self.data, self.row_bytes));
        QMatrix {
            data,
            row_lanes: true,
            ..self
        }
    }

    /// Whether the bytes are in the row-lane layout (see [`Self::prepared_for`]).
    pub fn is_row_lanes(&self) -> bool {
        self.row_lanes
    }

    /// The 2-D tensor `name` of a GGUF file, pointing into the file's mapping (no copy).
    ///
    /// GGUF stores `ne = [cols, rows]` (`ne[0]` fastest), i.e. HF `[out, in]` as `rows = out`.
    pub fn from_gguf(file: &Arc<GgufFile>, name: &str) -> Result<Self, QError> {
        let bad = |reason: String| QError::Tensor {
            name: name.to_string(),
            reason,
        };
        let info = file
            .tensor_info(name)
            .ok_or_else(|| bad("not in the file".into()))?
            .clone();
        let dims: Vec<u64> = info.ne.clone();
        if dims.len() < 2 || dims[2..].iter().any(|&d| d != 1) {
            return Err(bad(format!("expected a 2-D matrix, found ne = {dims:?}")));
        }
        let to_usize =
            |d: u64| usize::try_from(d).map_err(|_| bad(format!("dimension {d} too large")));
        let (cols, rows) = (to_usize(dims[0])?, to_usize(dims[1])?);
        let ty = info.ggml_type;
        let data = WeightBytes::from_owner(file.clone(), move |f| f.bytes_of(&info));
        QMatrix::new(ty, rows, cols, data).map_err(|e| bad(e.to_string()))
    }

    /// Storage type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The stored bytes (rearranged when [`Self::is_row_lanes`]).
    pub fn raw(&self) -> &[u8] {
        &self.data
    }

    /// Resident bytes of the weight.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Dequantises rows `row0 .. row0 + out.len() / cols` into `out` (row-major f32), with values
    /// bit-identical to `ridgefill_io::quant::dequantize`.
    pub fn dequantize_rows_into(&self, row0: usize, out: &mut [f32]) -> Result<(), QError> {
        let end = row_end(row0, out.len(), self.cols, self.rows)?;
        let level = SimdLevel::detect();
        if self.row_lanes {
            let mut row = vec![0u8; self.row_bytes];
            for (r, o) in (row0..end).zip(out.chunks_exact_mut(self.cols)) {
                lanes::unpack_row(self.ty, &self.data, self.row_bytes, r, &mut row);
                crate::dequant::dequantize_into(level, self.ty, &row, o);
            }
            return Ok(());
        }
        let raw = &self.data[row0 * self.row_bytes..end * self.row_bytes];
        crate::dequant::dequantize_into(level, self.ty, raw, out);
        Ok(())
    }
}

/// The end of the rows `row0..` that `len` output values fill, checked to be whole rows inside
/// a weight of `rows` rows of `cols`.
fn row_end(row0: usize, len: usize, cols: usize, rows: usize) -> Result<usize, QError> {
    let end = row0.saturating_add(len / cols);
    if !len.is_multiple_of(cols) || end > rows {
        return Err(QError::RowRange {
            start: row0,
            end: row0.saturating_add(len.div_ceil(cols)),
            rows,
        });
    }
    Ok(end)
}

/// How [`QWeight::matmul_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulConfig {
    /// Kernel instruction set (must be available on this CPU; lower ones are always allowed).
    pub level: SimdLevel,
    /// Integer kernels, dequantise + f32 GEMM, or chosen by `m`.
    pub path: MatmulPath,
    /// Use the global pool (`true`) or only the calling thread.
    pub parallel: bool,
}

/// Which algorithm a matmul uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// Integer kernels below [`QWeight::f32_path_min_m`], dequantise + GEMM from there.
    Auto,
    /// Quantise x, integer dot products per block.
    Integer,
    /// Dequantise row chunks to f32 and run an f32 GEMM on them (no lasting f32 copy).
    DequantGemm,
    /// The path [`MatmulPath::Auto`] takes for a large batch, at any `m`: prompt rows then take
    /// f32 products whether a prefill runs them 8 or 256 at a time (a follow-up turn's few new
    /// rows as a cold prefill's chunks), without running more rows to get there. Only the
    /// summation order differs (dot-product tiles below 64 rows on AVX2, the GEMM above).
    Prompt,
}

impl Default for MatmulConfig {
    fn default() -> Self {
        MatmulConfig {
            level: SimdLevel::detect(),
            path: MatmulPath::Auto,
            parallel: true,
        }
    }
}

/// Batch size from which dequantise + f32 GEMM beats the integer kernels, per weight type.
///
/// Measured on a 1536 × 1536 weight, one thread, AVX2 (Zen 5), with
/// `cargo bench -p ridgefill-quant --bench gemv -- threshold`: the first m (of 1, 2, 4, 8, 16,
/// 24, 32, 48, 64, ...) from which the GEMM path took less CPU time: Q4_0 48, Q4_1 32, Q8_0 32,
/// Q4_K 24, and 16 for Q5_0, Q5_1, Q5_K, Q6_K, F16, BF16, F32 (near the crossover the two paths
/// differ by a few percent either way, so a step either side costs little). The integer cost
/// grows linearly in m (each activation row is a GEMV over the cached weight tile); the GEMM path
/// pays a fixed dequantisation (≈ 0.15 ns per weight) and then runs at f32 GEMM speed.
///
/// With AVX-512 VNNI, Q4_0, Q4_1 and Q8_0 never leave the integer path: from four activation rows
/// their row-lane kernels run one row per vector lane, and on one thread they take 4.7 (Q4_1) and
/// 6.0 ms (Q8_0) at m = 256 against the GEMM path's 11.5 (Xeon); SmolLM2 Q4_1's pp512 on 2
/// threads then matched `--weights f32` (1074 / 1036 against 1085 / 1028 t/s) where the GEMM
/// path trailed (1029 / 985).
///
/// Row-lane weights (AVX-VNNI or AVX-512 VNNI, see [`QMatrix::prepared_for`]) likewise stay on
/// their kernels at every batch size.
fn f32_path_min_m(level: SimdLevel, ty: GgmlType, row_lanes: bool) -> usize {
    match (level, ty) {
        (_, _) if row_lanes => usize::MAX,
        (SimdLevel::Avx512Vnni, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) => usize::MAX,
        (_, GgmlType::Q4_0) => 48,
        (_, GgmlType::Q4_1 | GgmlType::Q8_0) => 32,
        (_, GgmlType::Q4_K) => 24,
        _ => 16,
    }
}

/// Below this many multiply-adds a matmul stays on the calling thread.
const PARALLEL_MIN_MACS: usize = 64 * 1024;
/// Chunks per thread the rows are cut into (so a descheduled thread costs little).
const CHUNKS_PER_THREAD: usize = 4;
/// At most this many weights per chunk (≈ 10-20 µs of GEMV): a big matrix such as the output
/// head is cut finer, so a thread the OS preempts mid-chunk holds little work back.
const CHUNK_MAX_WEIGHTS: usize = 1 << 18;
/// Rows per chunk are a multiple of this (the kernels take 4 rows at a time).
const ROW_ALIGN: usize = 16;
/// Weight rows kept hot in L1 while every activation row passes over them (integer path, m > 1).
const ROW_TILE: usize = 16;
/// [`ROW_TILE`] for row-lane weights: their kernels take sixteen rows per pass anyway, so the
/// tile is as many rows as L1 holds comfortably (64 rows of 576 Q4_1 columns: 23 KB).
const LANES_TILE: usize = 64;
/// Activation rows the integer path runs against each weight tile at once (m > 1).
const ACT_GROUP: usize = 4;
/// A remainder of two or three activation rows still shares each unpacked block by twos.
const PAIR: usize = 2;
/// With 32 vector registers (AVX-512) eight activation rows fit a pass.
const WIDE_GROUP: usize = 8;
/// Rows per chunk of the dequantise + GEMM path (the f32 scratch is this × cols floats).
const GEMM_CHUNK_ROWS: usize = 64;

/// Several [`QMatrix`] stacked along the output rows (e.g. fused Q/K/V or gate/up), used as one
/// `[rows_total, cols]` weight. Parts may have different types.
#[derive(Clone, Debug)]
pub struct QWeight {
    parts: Vec<QMatrix>,
    /// Row offset of each part in the stacked output.
    starts: Vec<usize>,
    rows: usize,
    cols: usize,
}

impl From<QMatrix> for QWeight {
    fn from(m: QMatrix) -> Self {
        QWeight {
            rows: m.rows,
            cols: m.cols,
            starts: vec![0],
            parts: vec![m],
        }
    }
}

/// Per-thread activation scratch (reused across calls so decode allocates nothing).
#[derive(Default)]
struct Acts {
    q8: Q8Buf,
    q8k: Q8KBuf,
}

thread_local! {
    static ACTS: RefCell<Acts> = RefCell::new(Acts::default());
    static F32_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The Q8 activation row a row-lane weight (Q4_0, Q4_1, Q8_0) takes.
fn q8(x: XRow<'_>) -> Q8Row<'_> {
    match x {
        XRow::Q8(x) => x,
        _ => unreachable!("row-lane weights take Q8 activations"),
    }
}

/// A pointer the chunks write disjoint parts of `y` through.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: chunks write disjoint element sets; the dispatching call waits for all of them.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element `off` past the start (a method, so closures capture the whole `OutPtr`).
    ///
    /// # Safety
    /// `off` is inside the buffer.
    unsafe fn at(self, off: usize) -> *mut f32 {
        // SAFETY: guaranteed by the caller.
        unsafe { self.0.add(off) }
    }
}

impl QWeight {
    /// Stacks `parts` (all with the same `cols`) in order.
    pub fn new(parts: Vec<QMatrix>) -> Result<Self, QError> {
        let first = parts.first().ok_or(QError::NoParts)?.cols;
        let mut starts = Vec::with_capacity(parts.len());
        let mut rows = 0usize;
        for (index, p) in parts.iter().enumerate() {
            if p.cols != first {
                return Err(QError::ColsMismatch {
                    first,
                    index,
                    found: p.cols,
                });
            }
            starts.push(rows);
            rows += p.rows;
        }
        Ok(QWeight {
            parts,
            starts,
            rows,
            cols: first,
        })
    }

    /// Every part [`QMatrix::prepared_for`] `level`.
    pub fn prepared_for(self, level: SimdLevel) -> QWeight {
        QWeight {
            parts: self
                .parts
                .into_iter()
                .map(|p| p.prepared_for(level))
                .collect(),
            ..self
        }
    }

    /// Output features (all parts).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Resident bytes of all parts.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(QMatrix::bytes).sum()
    }

    /// The stacked parts.
    pub fn parts(&self) -> &[QMatrix] {
        &self.parts
    }

    /// Batch size from which [`MatmulPath::Auto`] dequantises and runs an f32 GEMM with the
    /// kernels of `level`: the smallest of the parts' thresholds (then the whole call takes that
    /// path).
    pub fn f32_path_min_m(&self, level: SimdLevel) -> usize {
        self.parts
            .iter()
            .map(|p| f32_path_min_m(level, p.ty, p.row_lanes))
            .min()
            .unwrap_or(usize::MAX)
    }

    /// The whole weight as f32, `[rows, cols]` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        // Cannot fail: the buffer covers every row exactly.
        let _ = self.dequantize_rows_into(0, &mut out);
        out
    }

    /// Dequantises stacked rows `row0 .. row0 + out.len() / cols` into `out`.
    pub fn dequantize_rows_into(&self, row0: usize, out: &mut [f32]) -> Result<(), QError> {
        let end = row_end(row0, out.len(), self.cols, self.rows)?;
        for (p, &start) in self.parts.iter().zip(&self.starts) {
            let (lo, hi) = (row0.max(start), end.min(start + p.rows));
            if lo < hi {
                let o = &mut out[(lo - row0) * self.cols..(hi - row0) * self.cols];
                p.dequantize_rows_into(lo - start, o)?;
            }
        }
        Ok(())
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ` (row-major), with the detected SIMD level, the global pool
    /// and the path chosen by `m`.
    ///
    /// Wrong `x` / `y` lengths are an [`QError::OperandLength`]; nothing else fails. On the
    /// integer path each activation row is rounded to 8 bits per block of 32 (legacy formats)
    /// or 256 (k-quants) values, scaled by the block's largest magnitude, so the result differs
    /// from the exact product by at most Σ_blocks (amax/254)·Σ|w| (see the tests). Non-finite
    /// activations give meaningless (possibly non-finite) outputs, never a panic.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<(), QError> {
        self.matmul_with(&MatmulConfig::default(), x, m, y)
    }

    /// [`Self::matmul`] with an explicit configuration (tests, benchmarks).
    ///
    /// A `cfg.level` the CPU lacks falls back to the detected level.
    pub fn matmul_with(
        &self,
        cfg: &MatmulConfig,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) -> Result<(), QError> {
        let check = |what, found: usize, width: usize| {
            if Some(found) == m.checked_mul(width) {
                Ok(())
            } else {
                Err(QError::OperandLength {
                    what,
                    found,
                    m,
                    width,
                })
            }
        };
        check("x", x.len(), self.cols)?;
        check("y", y.len(), self.rows)?;
        if m == 0 {
            return Ok(());
        }
        let level = if cfg.level.is_available() {
            cfg.level
        } else {
            SimdLevel::detect()
        };
        let pool = cfg.parallel.then(Pool::global);
        let dequant = match cfg.path {
            MatmulPath::Auto => m >= self.f32_path_min_m(level),
            MatmulPath::Prompt => self.f32_path_min_m(level) != usize::MAX,
            MatmulPath::Integer => false,
            MatmulPath::DequantGemm => true,
        };
        if dequant {
            self.matmul_gemm(level, pool, x, m, y);
        } else {
            self.matmul_int(level, pool, x, m, y);
        }
        Ok(())
    }

    /// How many row chunks of at most `chunk` rows the parts split into (none spans two parts).
    fn chunk_count(&self, chunk: usize) -> usize {
        self.parts.iter().map(|p| p.rows.div_ceil(chunk)).sum()
    }

    /// Chunk `c` of [`Self::chunk_count`]: `(part, first row, end row)` within the part.
    fn chunk_at(&self, chunk: usize, mut c: usize) -> (usize, usize, usize) {
        for (i, p) in self.parts.iter().enumerate() {
            let n = p.rows.div_ceil(chunk);
            if c < n {
                return (i, c * chunk, ((c + 1) * chunk).min(p.rows));
            }
            c -= n;
        }
        unreachable!("chunk index past chunk_count")
    }

    /// Rows per chunk for `threads` threads.
    fn chunk_rows(&self, threads: usize) -> usize {
        let target = self
            .rows
            .div_ceil(threads * CHUNKS_PER_THREAD)
            .min(CHUNK_MAX_WEIGHTS / self.cols);
        target.div_ceil(ROW_ALIGN).max(1) * ROW_ALIGN
    }

    fn matmul_int(
        &self,
        level: SimdLevel,
        pool: Option<&Pool>,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) {
        let pool = pool.filter(|_| m * self.rows * self.cols >= PARALLEL_MIN_MACS);
        let need = |k| self.parts.iter().any(|p| act_kind(p.ty) == Some(k));
        let mut run = |acts: &mut Acts| {
            if need(ActKind::Q8) {
                acts.q8.reset(m, self.cols);
                acts.q8.quantize(level, x, pool);
            }
            if need(ActKind::Q8K) {
                acts.q8k.reset(m, self.cols);
                acts.q8k.quantize(level, x, pool);
            }
            let acts = &*acts;
            let threads = pool.map_or(1, Pool::threads);
            let chunk = self.chunk_rows(threads);
            let out = OutPtr(y.as_mut_ptr());
            let (rows_total, cols) = (self.rows, self.cols);
            let job = |c: usize| {
                let (pi, r0, r1) = self.chunk_at(chunk, c);
                let p = &self.parts[pi];
                let start = self.starts[pi];
                let kind = act_kind(p.ty);
                let xrow = |i: usize| match kind {
                    Some(ActKind::Q8) => XRow::Q8(acts.q8.row(i)),
                    Some(ActKind::Q8K) => XRow::Q8K(acts.q8k.row(i)),
                    _ => XRow::F32(&x[i * cols..(i + 1) * cols]),
                };
                // A whole chunk where one pass of activation rows covers it; else weight tiles
                // kept in L1 while every group passes.
                let tile = match (p.row_lanes, m) {
                    (_, 1) => r1 - r0,
                    (true, m) if m <= WIDE_GROUP => r1 - r0,
                    (true, _) => LANES_TILE,
                    (false, _) => ROW_TILE,
                };
                // With 32 vector registers eight activation rows share each weight block.
                let wide = match p.row_lanes {
                    true => lanes_level(level) == SimdLevel::Avx512Vnni,
                    false => level == SimdLevel::Avx512Vnni,
                };
                let mut t0 = r0;
                while t0 < r1 {
                    let t1 = (t0 + tile).min(r1);
                    let w = &p.raw()[t0 * p.row_bytes..t1 * p.row_bytes];
                    // SAFETY: y has m·rows_total values (checked by matmul_with); this chunk
                    // alone writes columns start+t0..start+t1 of y's rows.
                    let o = |i: usize| unsafe {
                        std::slice::from_raw_parts_mut(out.at(i * rows_total + start + t0), t1 - t0)
                    };
                    // `$n` activation rows from `$i` against this weight tile; each weight block
                    // is unpacked once per group.
                    macro_rules! group {
                        ($n:expr, $i:expr) => {{
                            let xs: [XRow<'_>; $n] = std::array::from_fn(|k| xrow($i + k));
                            let os: [&mut [f32]; $n] = std::array::from_fn(|k| o($i + k));
                            if p.row_lanes {
                                gemv_lanes(level, p.ty, w, p.row_bytes, xs.map(q8), os);
                            } else if $n == 1 {
                                let [o, ..] = os;
                                gemv_rows(level, p.ty, w, p.row_bytes, xs[0], o);
                            } else {
                                gemv_rows_multi(level, p.ty, w, p.row_bytes, xs, os);
                            }
                        }};
                    }
                    let mut i = 0;
                    while wide && i + WIDE_GROUP <= m {
                        group!(WIDE_GROUP, i);
                        i += WIDE_GROUP;
                    }
                    while i + ACT_GROUP <= m {
                        group!(ACT_GROUP, i);
                        i += ACT_GROUP;
                    }
                    if i + PAIR <= m {
                        group!(PAIR, i);
                        i += PAIR;
                    }
                    for i in i..m {
                        group!(1, i);
                    }
                    t0 = t1;
                }
            };
            let n = self.chunk_count(chunk);
            match pool {
                Some(pool) => pool.run(n, &job),
                None => (0..n).for_each(job),
            }
        };
        ACTS.with(|a| match a.try_borrow_mut() {
            Ok(mut acts) => run(&mut acts),
            // Re-entered on this thread: use a fresh scratch.
            Err(_) => run(&mut Acts::default()),
        });
    }

    fn matmul_gemm(
        &self,
        level: SimdLevel,
        pool: Option<&Pool>,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) {
        let chunk = GEMM_CHUNK_ROWS;
        let out = OutPtr(y.as_mut_ptr());
        let (rows_total, cols) = (self.rows, self.cols);
        let job = |c: usize| {
            let (pi, r0, r1) = self.chunk_at(chunk, c);
            let p = &self.parts[pi];
            let n = r1 - r0;
            let dst_col = self.starts[pi] + r0;
            let gemm_chunk = |w: &mut Vec<f32>| {
                w.resize(n * cols, 0.0);
                // Cannot fail: the range is inside the part.
                let _ = p.dequantize_rows_into(r0, &mut w[..n * cols]);
                // SAFETY: y[0..m, dst_col..dst_col+n] (row stride rows_total) is inside y and
                // written only by this chunk.
                let small = m < SMALL_M_MAX
                    && unsafe {
                        dot_tiles(level, x, &w[..n * cols], cols, out.at(dst_col), rows_total)
                    };
                if small {
                    return;
                }
                // SAFETY: dst is y[0..m, dst_col..dst_col+n] (row stride rows_total), inside y and
                // written only by this chunk; lhs is x [m, cols]; rhs[k, j] = w[j·cols + k].
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        cols,
                        out.at(dst_col),
                        1,
                        rows_total as isize,
                        false,
                        x.as_ptr(),
                        1,
                        cols as isize,
                        w.as_ptr(),
                        cols as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            };
            F32_SCRATCH.with(|s| match s.try_borrow_mut() {
                Ok(mut w) => gemm_chunk(&mut w),
                Err(_) => gemm_chunk(&mut Vec::new()),
            });
        };
        let n = self.chunk_count(chunk);
        match pool {
            Some(pool) => pool.run(n, &job),
            None => (0..n).for_each(job),
        }
    }
}
