//! Settling a filled cache while nothing else needs the machine: its filled rows, earliest
//! first, run the upper layers exactly from the split input their [`FillHistory`] keeps, and
//! replace their predicted K/V for good. A chat turn's fill buys its time to first token; the
//! pause before the next turn (the user reading, typing) then pays the rest of full prefill's
//! work, so the next turn reuses a cache with no predictions left and spends nothing on spans.
//!
//! Rows go in position order, so a settled row attends to rows that are all settled or exact
//! (its predecessors were settled before it, or in the same batch, causally); on a
//! sliding-window layer it therefore never reads a slot the fill left unwritten.

use crate::cache::KvCache;
use crate::decoder::{At, Decoder};
use crate::error::Result;

use super::{FillHistory, check_split};

/// Runs up to `max_rows` of the cache's filled rows (the earliest) through the layers from the
/// history's split up, from their stored split input, overwriting their predicted K/V and
/// recording them exact. Returns how many it ran (0: nothing left to settle). Rows run as one
/// batch: the cost of `max_rows` prompt rows over the upper layers, attention included.
///
/// # Shapes
/// - the cache's upper layers hold `cache.len()` positions, as `history` records them
pub fn settle(
    model: &Decoder,
    cache: &mut KvCache,
    history: &mut FillHistory,
    max_rows: usize,
) -> Result<usize> {
    let len = cache.len();
    let pick = history.filled_positions(len, max_rows);
    if pick.is_empty() {
        return Ok(0);
    }
    check_split(model, history.split)?;
    let mut h = history.h_split_rows(&pick)?;
    for l in history.split..model.num_layers() {
        h = model.block(l, h, cache, At::Rows(&pick)).0;
    }
    history.mark_exact(&pick);
    Ok(pick.len())
}
