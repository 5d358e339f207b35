//! The row-lane layout: Q4_0, Q4_1 and Q8_0 weights rearranged once at load so the AVX-512 VNNI
//! and AVX-VNNI kernels read sixteen rows' blocks as ready vectors (one row per 32-bit lane; the
//! 256-bit kernels take each vector as two halves of eight rows), instead of transposing them and
//! gathering their scales on every call (llama.cpp repacks likewise).
//!
//! Rows are grouped in tiles of [`TILE`]. Tile `t` takes the same bytes as rows `16t..16t+16`
//! did, block after block; block `b` of a tile holds, for this type's f16 fields in order (d,
//! then Q4_1's min), the sixteen rows' values side by side, then the quant bytes as 64-byte
//! vectors: vector `j` holds bytes `4j..4j+4` of each row's quants, row `r` in bytes `4r..4r+4`.
//! The same bytes, moved: sizes, offsets of whole tiles and the values are unchanged.

use ridgefill_io::GgmlType;

use crate::simd::SimdLevel;

/// Rows per tile: one per 32-bit lane of a 512-bit vector (two 256-bit halves).
pub(crate) const TILE: usize = 16;
/// Bytes of one f16 field.
const HALF: usize = 2;
/// Bytes of a quant group a lane holds (what `vpdpbusd` adds up).
const GROUP: usize = 4;

/// Whether weights of `ty` with `rows` rows are kept in the row-lane layout at `level`.
pub(crate) fn applies(level: SimdLevel, ty: GgmlType, rows: usize) -> bool {
    matches!(level, SimdLevel::AvxVnni | SimdLevel::Avx512Vnni)
        && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
        && rows.is_multiple_of(TILE)
}

/// f16 fields at the start of each block of `ty` (d; Q4_1 adds its min).
pub(crate) fn halves(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_1 => 2,
        _ => 1,
    }
}

/// Where byte `i` of a row's block lands in its tile's block, for row `r` of the tile.
fn lane_offset(ty: GgmlType, r: usize, i: usize) -> usize {
    let head = halves(ty) * HALF;
    if i < head {
        let (field, byte) = (i / HALF, i % HALF);
        field * TILE * HALF + r * HALF + byte
    } else {
        let q = i - head;
        let (group, byte) = (q / GROUP, q % GROUP);
        head * TILE + group * TILE * GROUP + r * GROUP + byte
    }
}

/// `raw` (row-major blocks, `rows` a multiple of [`TILE`]) in the row-lane layout.
pub(crate) fn pack(ty: GgmlType, raw: &[u8], row_bytes: usize) -> Vec<u8> {
    let ts = ty.type_size();
    let head = halves(ty) * HALF;
    let mut out = vec![0u8; raw.len()];
    for (src, dst) in raw
        .chunks_exact(TILE * row_bytes)
        .zip(out.chunks_exact_mut(TILE * row_bytes))
    {
        for (b, dst) in dst.chunks_exact_mut(TILE * ts).enumerate() {
            for r in 0..TILE {
                let block = &src[r * row_bytes + b * ts..][..ts];
                // Whole f16 fields and quant groups at once, not byte by byte (load time).
                for (f, half) in block[..head].chunks_exact(HALF).enumerate() {
                    let at = lane_offset(ty, r, f * HALF);
                    dst[at..at + HALF].copy_from_slice(half);
                }
                for (g, group) in block[head..].chunks_exact(GROUP).enumerate() {
                    let at = lane_offset(ty, r, head + g * GROUP);
                    dst[at..at + GROUP].copy_from_slice(group);
                }
            }
        }
    }
    out
}

/// Row `r` (of the whole matrix) back in its stored block format, into `row` (`row_bytes`).
pub(crate) fn unpack_row(ty: GgmlType, packed: &[u8], row_bytes: usize, r: usize, row: &mut [u8]) {
    let ts = ty.type_size();
    let tile = &packed[r / TILE * TILE * row_bytes..][..TILE * row_bytes];
    let lane = r % TILE;
    for (b, block) in row.chunks_exact_mut(ts).enumerate() {
        let src = &tile[b * TILE * ts..][..TILE * ts];
        for (i, v) in block.iter_mut().enumerate() {
            *v = src[lane_offset(ty, lane, i)];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_moves_every_byte_once_and_unpacks_back() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, blocks) = (2 * TILE, 3);
            let row_bytes = blocks * ty.type_size();
            let raw: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 7 % 251) as u8).collect();
            let packed = pack(ty, &raw, row_bytes);
            // A permutation of each tile-block: same multiset of bytes.
            let mut a = raw.clone();
            let mut b = packed.clone();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "{ty}");
            assert_ne!(raw, packed, "{ty}: packing moved nothing");
            let mut row = vec![0u8; row_bytes];
            for r in 0..rows {
                unpack_row(ty, &packed, row_bytes, r, &mut row);
                assert_eq!(row, raw[r * row_bytes..][..row_bytes], "{ty} row {r}");
            }
        }
    }

    #[test]
    fn the_layout_is_the_one_the_kernels_read() {
        // Q4_1, tile row 5, block 0: d at 2·5, min at 32 + 2·5, quant bytes 4..8 in vector 1.
        let ty = GgmlType::Q4_1;
        assert_eq!(lane_offset(ty, 5, 0), 10);
        assert_eq!(lane_offset(ty, 5, 3), 32 + 11);
        assert_eq!(lane_offset(ty, 5, 4 + 4), 64 + 64 + 20);
        // Q8_0: quant byte 31 of row 15 is the last byte of the block's last vector.
        let ty = GgmlType::Q8_0;
        assert_eq!(lane_offset(ty, 15, 2 + 31), TILE * ty.type_size() - 1);
    }
}
