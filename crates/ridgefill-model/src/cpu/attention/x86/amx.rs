//! AMX attention of a block of stacked query rows over one chunk of keys: [`super::block`]'s
//! contract (the same softmax parts, a row's result independent of the rows sharing its block)
//! with Q·Kᵀ and P·V as bf16 tile products. Each f32 operand is split into a bf16 head and a
//! bf16 remainder and a product is the three larger of the four partial products (hi·hi +
//! lo·hi + hi·lo, f32 accumulation), which keeps ~16 of f32's 24 mantissa bits: the errors
//! stay below the 8-bit activations' that the weights already bring.
//!
//! Written by hand because no crate drives AMX from stable Rust (its intrinsics are unstable;
//! the tile instructions go through `asm!`), and a follow-up turn's attention over a long cache
//! is an FMA-bound product the AVX-512 kernel cannot shorten: 19 rows over 3019 keys need ≥ 10 ms
//! of this machine's whole f32 FMA rate, a third of the cold turn's time (docs/prefix-reuse.md).
//! A tile product does 16 × 16 × 32 multiply-adds in ~5 ns (3 TFLOP/s a core, Xeon model 167);
//! what is left is converting K, V and the weights to tiles each call and the softmax. Measured
//! there (2 threads, AMX on/off): attention of 19 rows over 3000 keys, 30 layers from memory,
//! 30.0 → 22.4 ms; a fresh 2048-token prefill 2206 → 1901 ms.
//!
//! Layouts (tiles are 16 rows of 64 bytes): scores are kept keys × rows as in [`super::block`]
//! (`Sᵀ = K·Qᵀ`: K rows are the A tiles as stored, Qᵀ the B tiles in pairs of dimensions), and
//! the output rows × dimensions (`O = P·V`: V rows in pairs of keys are the B tiles, P transposed
//! from the scores into A tiles by a 16 × 16 shuffle).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::block::{BlockIn, softmax_keys};
use super::prefetch_bytes;

/// f32 lanes per vector, rows per tile, and dword columns per tile row.
const W: usize = 16;
/// Bytes per tile row.
const TILE_ROW: usize = 64;
/// Dwords per tile.
const TILE: usize = W * W;
/// bf16 elements per tile row: the dimensions (or keys) one tile product reduces.
const DEPTH: usize = 2 * W;
/// Keys ahead whose K and V rows are prefetched while a block is converted: the cache streams
/// from memory (every other layer's K/V went through the caches since).
const PREFETCH_KEYS: usize = 32;
/// Value columns whose output tiles stay in tile registers together (tmm0–3).
const OUT_TILES: usize = 4;
/// Environment variable that switches the AMX kernel `on` (or `1`) where the CPU has AMX; `off`,
/// `0` or unset keep the AVX-512 f32 kernel. Off by default: its products (~2⁻¹⁶ of f32) move
/// native-weight logits through the 8-bit activations as much as another weight format does —
/// full prefill's greedy answers to the 24 document questions agreed with the f32 kernel's in
/// 13 (ROUGE-L 0.75, the f32-vs-native floor's level), and "What is the capital of France?"
/// (a 0.3-nat near-tie) answered in French.
pub const AMX_SWITCH: &str = "RIDGEFILL_AMX";

/// Linux `arch_prctl` request for permission to use an extended state component.
const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
/// The AMX tile data state component.
const XFEATURE_XTILEDATA: i64 = 18;
/// The `arch_prctl` system call's number on x86-64 Linux.
const SYS_ARCH_PRCTL: i64 = 158;

/// Whether [`group_block`] runs for head size `hd`: [`AMX_SWITCH`] on and [`cpu_ready`].
pub fn usable(hd: usize) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| {
        switched_on(std::env::var(AMX_SWITCH).ok().as_deref()).unwrap_or_else(|msg| {
            eprintln!("warning: {msg}");
            false
        })
    });
    on && cpu_ready(hd)
}

/// Whether the CPU can run [`group_block`] for head size `hd`: a multiple of [`OUT_TILES`] tiles
/// of columns, AMX-BF16 and AVX-512, and the kernel's permission granted.
pub fn cpu_ready(hd: usize) -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    hd > 0 && hd.is_multiple_of(OUT_TILES * W) && *READY.get_or_init(ready)
}

/// Whether [`AMX_SWITCH`]'s `value` lets the kernel run; `Err` names a value that is neither.
fn switched_on(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        Some("on" | "1") => Ok(true),
        None | Some("off" | "0" | "") => Ok(false),
        Some(v) => Err(format!(
            "{AMX_SWITCH}={v:?}: expected on or off (1 or 0); AMX stays off"
        )),
    }
}

fn ready() -> bool {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx512f") && has!("avx512bw")) {
        return false;
    }
    let leaf = __cpuid_count(7, 0);
    let (tile, bf16) = (leaf.edx >> 24 & 1 == 1, leaf.edx >> 22 & 1 == 1);
    if !(tile && bf16 && cfg!(target_os = "linux")) {
        return false;
    }
    let rc: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only asks the kernel to grant the
    // process the tile state; it reads and writes no memory of ours. rcx and r11 are clobbered
    // by `syscall`.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => rc,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    rc == 0
}

/// A cache line: tile rows must not straddle two (a tile load then takes ~6× as long: 18 against
/// 2.8 ns, Xeon model 167).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u32; W]);

/// A growable buffer of cache lines, read and written through raw pointers as f32, u32 or u16.
#[derive(Default)]
struct Lines(Vec<Line>);

impl Lines {
    /// Room for `bytes` bytes, from a cache line's start; old contents are kept, not zeroed.
    fn room(&mut self, bytes: usize) -> *mut u8 {
        let lines = bytes.div_ceil(TILE_ROW);
        if self.0.len() < lines {
            self.0.resize(lines, Line::default());
        }
        self.0.as_mut_ptr() as *mut u8
    }
}

/// The kernel's buffers, kept per thread across calls.
#[derive(Default)]
pub struct AmxScratch {
    /// Qᵀ as B tiles: `[hd / 32][row tile][head, remainder]`, a tile each.
    qb: Lines,
    /// K as A tiles: `[key blocks of 16][hd / 32][head, remainder][16 keys][32 bf16]`.
    kb: Lines,
    /// Scores, then softmax weights: `[keys rounded up to 32, lanes]` f32.
    s: Lines,
    /// P as A tiles: `[key pairs / 16][row tile][head, remainder]`.
    pa: Lines,
    /// V as B tiles: `[key pairs / 16][column tile][head, remainder]`.
    vb: Lines,
    /// Outputs before the division by the softmax sums: `[lanes, hd]` f32.
    out: Lines,
}

/// The tile configuration: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    const fn all_full() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            // Bytes per row (u16 little-endian at 16 + 2t), then rows (at 48 + t).
            c[16 + 2 * t] = TILE_ROW as u8;
            c[48 + t] = W as u8;
            t += 1;
        }
        Self(c)
    }
}

static CONFIG: TileConfig = TileConfig::all_full();

/// Tile instructions on fixed tile registers (`asm!` names them; none is an operand).
macro_rules! tile {
    (zero $t:literal) => {
        asm!(concat!("tilezero tmm", $t), options(nostack))
    };
    (load $t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack, readonly)
        )
    };
    (store $t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $t),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack)
        )
    };
    (dp $c:literal, $a:literal, $b:literal) => {
        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack))
    };
}

/// Output tile `$c` += the A operand (head in tmm4, remainder in tmm5) times the B operand whose
/// head tile is at `$b` and remainder tile right after it (loaded into tmm6, tmm7): the three
/// larger partial products, the smaller ones first.
macro_rules! three_products {
    ($c:literal, $b:expr) => {{
        let b_hi = $b;
        tile!(load 6, b_hi, TILE_ROW);
        tile!(load 7, b_hi.add(TILE), TILE_ROW);
        tile!(dp $c, 5, 6);
        tile!(dp $c, 4, 7);
        tile!(dp $c, 4, 6);
    }};
}

/// Runs `$body!(tile, index)` for output tiles `0..$n` (at most four: tmm0–3).
macro_rules! each_out {
    ($n:expr, $body:ident) => {
        if $n > 0 {
            $body!(0, 0usize);
        }
        if $n > 1 {
            $body!(1, 1usize);
        }
        if $n > 2 {
            $body!(2, 2usize);
        }
        if $n > 3 {
            $body!(3, 3usize);
        }
    };
}

/// [`super::group_block`] on AMX tiles; the arguments and results are its.
///
/// # Shapes
/// - q, o: `[m, hd]` row-major; live, stats: `[m]`, m ≤ [`super::BLOCK_ROWS_MAX`]
///
/// # Safety
/// [`usable`]`(hd)`; keys `j < max(live)` are at `ks + j·k_row` and values at `vs + j·v_row`,
/// `hd` readable f32s each.
pub unsafe fn group_block(
    x: BlockIn,
    buf: &mut AmxScratch,
    o: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match x.live.len().div_ceil(W) {
            1 => run::<1>(x, buf, o, stats),
            2 => run::<2>(x, buf, o, stats),
            3 => run::<3>(x, buf, o, stats),
            _ => run::<4>(x, buf, o, stats),
        }
    }
}

/// [`group_block`] with `NV` tiles of 16 stacked rows.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run<const NV: usize>(
    x: BlockIn,
    buf: &mut AmxScratch,
    o: &mut [f32],
    stats: &mut [(f32, f32)],
) {
    let (q, hd, live, scale) = (x.q, x.hd, x.live, x.scale);
    let (ks, k_row, vs, v_row) = (x.ks, x.k_row, x.vs, x.v_row);
    let lanes = NV * W;
    let m = live.len();
    let n = live.iter().copied().max().unwrap_or(0);
    let padded = n.next_multiple_of(DEPTH);
    let depth_tiles = hd / DEPTH;
    // Every element of these is written below before it is read: no zeroing.
    let pairs = padded / DEPTH;
    let tile_bytes = TILE * size_of::<u32>();
    let qb = buf.qb.room(depth_tiles * NV * 2 * tile_bytes) as *mut u32;
    let kb = buf.kb.room(n.div_ceil(W) * depth_tiles * 2 * tile_bytes) as *mut u16;
    let s = buf.s.room(padded * lanes * size_of::<f32>()) as *mut f32;
    let pa = buf.pa.room(pairs * NV * 2 * tile_bytes) as *mut u32;
    let vb = buf.vb.room(pairs * (hd / W) * 2 * tile_bytes) as *mut u32;
    let out = buf.out.room(lanes * hd * size_of::<f32>()) as *mut f32;
    let row_bytes = hd * size_of::<f32>();
    // SAFETY: every buffer was sized above for the tiles written and read below; keys and
    // values j < n are readable (caller), rows n.. of a block are zeros, never read from the
    // cache (prefetches never fault). The tile state is configured here and released before
    // returning.
    unsafe {
        // Qᵀ tiles: row i of tile (t, r) pairs dimensions 32t + i and 32t + 16 + i of rows
        // 16r..16r+16 (K rows are paired alike): each row's pairs, transposed.
        let scale = _mm512_set1_ps(scale);
        for t in 0..depth_tiles {
            for r in 0..NV {
                let mut hi = [_mm512_setzero_si512(); W];
                let mut lo = [_mm512_setzero_si512(); W];
                for u in 0..W.min(m.saturating_sub(r * W)) {
                    let row = q.as_ptr().add((r * W + u) * hd + t * DEPTH);
                    let a = _mm512_mul_ps(scale, _mm512_loadu_ps(row));
                    let b = _mm512_mul_ps(scale, _mm512_loadu_ps(row.add(W)));
                    (hi[u], lo[u]) = pair_vectors(a, b);
                }
                transpose16(&mut hi);
                transpose16(&mut lo);
                let tile = qb.add(((t * NV + r) * 2) * TILE);
                for i in 0..W {
                    _mm512_storeu_si512(tile.add(i * W) as *mut _, hi[i]);
                    _mm512_storeu_si512(tile.add(TILE + i * W) as *mut _, lo[i]);
                }
            }
        }
        // K as A tiles, every block of 16 keys before any product: one stream from memory.
        let blocks = n.div_ceil(W);
        for blk in 0..blocks {
            let j0 = blk * W;
            for u in 0..W {
                let j = j0 + PREFETCH_KEYS + u;
                prefetch_bytes(ks.wrapping_add(j * k_row) as *const i8, row_bytes);
            }
            for t in 0..depth_tiles {
                let at = kb.add((blk * depth_tiles + t) * 2 * W * DEPTH);
                for u in 0..W {
                    let (hi, lo) = if j0 + u < n {
                        split_row32(ks.add((j0 + u) * k_row + t * DEPTH))
                    } else {
                        (_mm512_setzero_si512(), _mm512_setzero_si512())
                    };
                    _mm512_storeu_si512(at.add(u * DEPTH) as *mut _, hi);
                    _mm512_storeu_si512(at.add((W + u) * DEPTH) as *mut _, lo);
                }
            }
        }
        asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
        // Scores Sᵀ = K·Qᵀ, 16 keys a pass: s[j, lanes] for keys j0..j0+16.
        let stride_s = lanes * size_of::<f32>();
        for blk in 0..blocks {
            macro_rules! zero_out {
                ($c:literal, $r:expr) => {
                    tile!(zero $c)
                };
            }
            each_out!(NV, zero_out);
            for t in 0..depth_tiles {
                let k_hi = kb.add((blk * depth_tiles + t) * 2 * W * DEPTH);
                let k_lo = k_hi.add(W * DEPTH);
                tile!(load 4, k_hi, TILE_ROW);
                tile!(load 5, k_lo, TILE_ROW);
                macro_rules! scores {
                    ($c:literal, $r:expr) => {
                        three_products!($c, qb.add(((t * NV + $r) * 2) * TILE))
                    };
                }
                each_out!(NV, scores);
            }
            macro_rules! store_scores {
                ($c:literal, $r:expr) => {
                    tile!(store $c, s.add(blk * W * lanes + $r * W), stride_s)
                };
            }
            each_out!(NV, store_scores);
        }
        let (top, sum) = softmax_keys::<NV>(s, n, lanes, live);
        // Pad keys n..padded weigh nothing (their scores were zeros, not −∞).
        std::ptr::write_bytes(s.add(n * lanes), 0, (padded - n) * lanes);
        // P tiles: row r of tile (p, r-tile) pairs keys 32p + 2i, +1 for i in 0..16 — the
        // key pairs of 16 lanes, transposed.
        for p in 0..pairs {
            for r in 0..NV {
                let mut hi = [_mm512_setzero_si512(); W];
                let mut lo = [_mm512_setzero_si512(); W];
                for i in 0..W {
                    let j = p * DEPTH + 2 * i;
                    (hi[i], lo[i]) =
                        pair_rows(s.add(j * lanes + r * W), s.add((j + 1) * lanes + r * W));
                }
                transpose16(&mut hi);
                transpose16(&mut lo);
                let tile = pa.add(((p * NV + r) * 2) * TILE);
                for i in 0..W {
                    _mm512_storeu_si512(tile.add(i * W) as *mut _, hi[i]);
                    _mm512_storeu_si512(tile.add(TILE + i * W) as *mut _, lo[i]);
                }
            }
        }
        // V tiles: row i of tile (p, c) pairs keys 32p + 2i, +1 over columns 16c..16c+16.
        let columns = hd / W;
        for p in 0..pairs {
            for u in 0..DEPTH {
                let j = (p * DEPTH + PREFETCH_KEYS + u).min(n);
                prefetch_bytes(vs.wrapping_add(j * v_row) as *const i8, row_bytes);
            }
            for c in 0..columns {
                let tile = vb.add(((p * columns + c) * 2) * TILE);
                for i in 0..W {
                    let j = p * DEPTH + 2 * i;
                    let row = |j: usize| {
                        if j < n {
                            _mm512_loadu_ps(vs.add(j * v_row + c * W))
                        } else {
                            _mm512_setzero_ps()
                        }
                    };
                    let (a, b) = (row(j), row(j + 1));
                    let (hi, lo) = pair_vectors(a, b);
                    _mm512_storeu_si512(tile.add(i * W) as *mut _, hi);
                    _mm512_storeu_si512(tile.add(TILE + i * W) as *mut _, lo);
                }
            }
        }
        // O = P·V, four column tiles at a time per row tile.
        let stride_o = hd * size_of::<f32>();
        for r in 0..NV {
            for c0 in (0..columns).step_by(OUT_TILES) {
                macro_rules! zero_out {
                    ($c:literal, $i:expr) => {
                        tile!(zero $c)
                    };
                }
                each_out!(OUT_TILES, zero_out);
                for p in 0..pairs {
                    let p_hi = pa.add(((p * NV + r) * 2) * TILE);
                    tile!(load 4, p_hi, TILE_ROW);
                    tile!(load 5, p_hi.add(TILE), TILE_ROW);
                    macro_rules! weigh {
                        ($c:literal, $i:expr) => {
                            three_products!($c, vb.add(((p * columns + c0 + $i) * 2) * TILE))
                        };
                    }
                    each_out!(OUT_TILES, weigh);
                }
                macro_rules! store_out {
                    ($c:literal, $i:expr) => {
                        tile!(store $c, out.add(r * W * hd + (c0 + $i) * W), stride_o)
                    };
                }
                each_out!(OUT_TILES, store_out);
            }
        }
        asm!("tilerelease", options(nostack));
        let mut tops = [0f32; 4 * W];
        let mut sums = [0f32; 4 * W];
        for v in 0..NV {
            _mm512_storeu_ps(tops.as_mut_ptr().add(v * W), top[v]);
            _mm512_storeu_ps(sums.as_mut_ptr().add(v * W), sum[v]);
        }
        for r in 0..m {
            stats[r] = (tops[r], sums[r]);
        }
        o.copy_from_slice(std::slice::from_raw_parts(out, m * hd));
    }
}

/// `x` split into the nearest bf16 (its head) and the bf16 nearest what the head leaves (exact
/// in f32), each rounded to nearest even by integer arithmetic (finite inputs) and held in the
/// upper 16 bits of a dword: head + remainder is `x` within 2⁻¹⁷ of `|x|`.
#[inline]
#[target_feature(enable = "avx512f")]
fn split(x: __m512) -> (__m512i, __m512i) {
    let upper = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let round = |b: __m512i| {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
        _mm512_and_si512(r, upper)
    };
    let hi = round(_mm512_castps_si512(x));
    let rest = _mm512_sub_ps(x, _mm512_castsi512_ps(hi));
    (hi, round(_mm512_castps_si512(rest)))
}

/// Two rows of 16 lanes as 16 bf16 pairs (`a` low, `b` high), head and remainder.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_vectors(a: __m512, b: __m512) -> (__m512i, __m512i) {
    let ((ah, al), (bh, bl)) = (split(a), split(b));
    let pair = |lo_half: __m512i, hi_half: __m512i| {
        _mm512_or_si512(_mm512_srli_epi32::<16>(lo_half), hi_half)
    };
    (pair(ah, bh), pair(al, bl))
}

/// [`pair_vectors`] of the 16 f32s at `a` and at `b`.
///
/// # Safety
/// Sixteen readable f32s at each.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair_rows(a: *const f32, b: *const f32) -> (__m512i, __m512i) {
    // SAFETY: the caller's contract.
    unsafe { pair_vectors(_mm512_loadu_ps(a), _mm512_loadu_ps(b)) }
}

/// The 32 f32s at `x` as 16 bf16 pairs (element `i` low, `16 + i` high), head and remainder:
/// a K row's 32 dimensions in the order the query tiles pair them ([`pair_rows`] of rows `i`
/// and `16 + i`), which a dot product does not see.
///
/// # Safety
/// 32 readable f32s at `x`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn split_row32(x: *const f32) -> (__m512i, __m512i) {
    // SAFETY: the caller's contract.
    unsafe { pair_rows(x, x.add(W)) }
}

/// Transposes 16 rows of 16 dwords in place (`rows[i][j]` ↔ `rows[j][i]`), by 32-bit, 64-bit
/// and two 128-bit interleaves.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(rows: &mut [__m512i; W]) {
    let r = *rows;
    let mut a = [_mm512_setzero_si512(); W];
    for k in 0..W / 2 {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    // x[4g + c]: lane L holds column 4L + c of rows 4g..4g+4.
    let mut x = [_mm512_setzero_si512(); W];
    for g in 0..W / 4 {
        let (lo0, hi0, lo1, hi1) = (a[4 * g], a[4 * g + 1], a[4 * g + 2], a[4 * g + 3]);
        x[4 * g] = _mm512_unpacklo_epi64(lo0, lo1);
        x[4 * g + 1] = _mm512_unpackhi_epi64(lo0, lo1);
        x[4 * g + 2] = _mm512_unpacklo_epi64(hi0, hi1);
        x[4 * g + 3] = _mm512_unpackhi_epi64(hi0, hi1);
    }
    for c in 0..4 {
        let (x0, x1, x2, x3) = (x[c], x[4 + c], x[8 + c], x[12 + c]);
        let y0 = _mm512_shuffle_i32x4::<0x88>(x0, x1);
        let y1 = _mm512_shuffle_i32x4::<0xdd>(x0, x1);
        let y2 = _mm512_shuffle_i32x4::<0x88>(x2, x3);
        let y3 = _mm512_shuffle_i32x4::<0xdd>(x2, x3);
        rows[c] = _mm512_shuffle_i32x4::<0x88>(y0, y2);
        rows[4 + c] = _mm512_shuffle_i32x4::<0x88>(y1, y3);
        rows[8 + c] = _mm512_shuffle_i32x4::<0xdd>(y0, y2);
        rows[12 + c] = _mm512_shuffle_i32x4::<0xdd>(y1, y3);
    }
}

#[cfg(test)]
mod tests {
    use super::super::block;
    use super::*;

    /// Stacked rows `m` over `n` keys of `hd`, some rows seeing fewer keys, through the AMX
    /// kernel and the f32 one: the same parts to f32's last few bits.
    #[test]
    fn tiles_agree_with_the_f32_kernel() {
        if !cpu_ready(64) {
            eprintln!("no AMX here: the kernel is not run");
            return;
        }
        let mut seed = 7u32;
        let mut values = |len: usize, half: f32| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 * half - half
                })
                .collect()
        };
        for (m, n, hd) in [(57, 512, 64), (16, 37, 64), (33, 500, 128), (4, 300, 256)] {
            let q = values(m * hd, 3.0);
            let k = values(n * hd, 3.0);
            let v = values(n * hd, 1.0);
            let live: Vec<usize> = (0..m).map(|r| n - (r * 7) % n.min(40)).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let run = |amx: bool| {
                let mut o = vec![0f32; m * hd];
                let mut stats = vec![(0f32, 0f32); m];
                let x = BlockIn {
                    q: &q,
                    hd,
                    live: &live,
                    ks: k.as_ptr(),
                    k_row: hd,
                    vs: v.as_ptr(),
                    v_row: hd,
                    scale,
                };
                // SAFETY: AMX and AVX-512 checked by `cpu_ready`; k and v hold n rows of hd.
                unsafe {
                    if amx {
                        group_block(x, &mut AmxScratch::default(), &mut o, &mut stats);
                    } else {
                        block::f32_block(x, &mut block::F32Scratch::default(), &mut o, &mut stats);
                    }
                }
                (o, stats)
            };
            let ((o, st), (want_o, want_st)) = (run(true), run(false));
            for r in 0..m {
                let ((top, sum), (want_top, want_sum)) = (st[r], want_st[r]);
                assert!(
                    (top - want_top).abs() < 1e-4 * want_top.abs().max(1.0),
                    "row {r}: top {top} vs {want_top}"
                );
                assert!(
                    (sum - want_sum).abs() < 1e-4 * want_sum,
                    "row {r}: sum {sum} vs {want_sum}"
                );
                for d in 0..hd {
                    let (x, want) = (o[r * hd + d] / sum, want_o[r * hd + d] / want_sum);
                    assert!(
                        (x - want).abs() < 2e-5,
                        "m {m} n {n} hd {hd} row {r} dim {d}: {x} vs {want}"
                    );
                }
            }
        }
    }

    /// The reused = cold guarantee's part here: a row's results are the same bits whatever rows
    /// share its block (a follow-up's few rows, or a whole prompt's block of 64).
    #[test]
    fn a_rows_parts_do_not_depend_on_its_block_mates() {
        if !cpu_ready(64) {
            eprintln!("no AMX here: the kernel is not run");
            return;
        }
        let (m, n, hd) = (57, 300, 64);
        let vals = |len: usize, salt: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7919 + salt * 104_729) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let (q, k, v) = (vals(m * hd, 1), vals(n * hd, 2), vals(n * hd, 3));
        let live: Vec<usize> = (0..m).map(|r| n - (m - 1 - r)).collect();
        let run = |rows: std::ops::Range<usize>| {
            let x = BlockIn {
                q: &q[rows.start * hd..rows.end * hd],
                hd,
                live: &live[rows.clone()],
                ks: k.as_ptr(),
                k_row: hd,
                vs: v.as_ptr(),
                v_row: hd,
                scale: 0.125,
            };
            let mut o = vec![0f32; rows.len() * hd];
            let mut stats = vec![(0f32, 0f32); rows.len()];
            // SAFETY: AMX and AVX-512 checked by `cpu_ready`; k and v hold n rows of hd.
            unsafe { group_block(x, &mut AmxScratch::default(), &mut o, &mut stats) };
            (o, stats)
        };
        let (all_o, all_stats) = run(0..m);
        for rows in [m - 19..m, m - 1..m, 20..40] {
            let (o, stats) = run(rows.clone());
            for (i, r) in rows.enumerate() {
                assert_eq!(
                    stats[i].0.to_bits(),
                    all_stats[r].0.to_bits(),
                    "row {r} top"
                );
                assert_eq!(
                    stats[i].1.to_bits(),
                    all_stats[r].1.to_bits(),
                    "row {r} sum"
                );
                for d in 0..hd {
                    let (a, b) = (o[i * hd + d], all_o[r * hd + d]);
                    assert_eq!(a.to_bits(), b.to_bits(), "row {r} dim {d}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn the_switch_takes_on_and_off_and_names_anything_else() {
        for v in [Some("on"), Some("1"), Some(" on ")] {
            assert_eq!(switched_on(v), Ok(true), "{v:?}");
        }
        for v in [None, Some("off"), Some("0"), Some(" ")] {
            assert_eq!(switched_on(v), Ok(false), "{v:?}");
        }
        let msg = switched_on(Some("yes")).unwrap_err();
        assert!(
            msg.contains("RIDGEFILL_AMX=\"yes\"") && msg.contains("on or off"),
            "{msg}"
        );
    }

    #[test]
    fn sixteen_rows_transpose() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let m: Vec<i32> = (0..256).collect();
        // SAFETY: m holds 16 rows of 16 dwords; avx512f checked above (as below).
        let mut rows: [__m512i; W] = std::array::from_fn(|i| unsafe {
            _mm512_loadu_si512(m.as_ptr().add(i * W) as *const _)
        });
        // SAFETY: avx512f checked above.
        unsafe { transpose16(&mut rows) };
        let mut out = [0i32; 256];
        for (i, r) in rows.iter().enumerate() {
            // SAFETY: out holds 16 rows of 16 dwords.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(i * W) as *mut _, *r) };
        }
        for i in 0..W {
            for j in 0..W {
                assert_eq!(out[i * W + j], m[j * W + i], "({i}, {j})");
            }
        }
    }
}
