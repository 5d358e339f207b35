//! Row-parallel work on the quantised kernels' pool, whose threads are awake between projections
//! (a second pool's threads would compete with them for the cores).

use ridgefill_quant::pool;

/// Elements below which a kernel stays on the calling thread (the pool's hand-off costs more).
pub(crate) const PARALLEL_MIN: usize = 1 << 15;
/// Tasks per thread a parallel kernel's work is cut into (attention's query blocks, row chunks),
/// so a descheduled thread holds little work back.
pub(crate) const TASKS_PER_THREAD: usize = 4;

/// Splits `out` into chunks of whole rows and runs `f(first_row, chunk)` on each, in parallel when
/// the work is large enough: on the quantised kernels' pool, whose threads are awake between
/// projections (a second pool's threads would compete with them for the cores).
pub(crate) fn for_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / row_len.max(1);
    if out.len() < PARALLEL_MIN || rows < 2 {
        f(0, out);
        return;
    }
    let per_task = rows.div_ceil(pool::threads() * TASKS_PER_THREAD).max(1);
    let chunk = per_task * row_len;
    let len = out.len();
    let base = SendPtr(out.as_mut_ptr());
    pool::for_each(len.div_ceil(chunk), &|t| {
        let start = t * chunk;
        // SAFETY: task t alone takes elements start..start + chunk of `out`, which outlives the
        // call (for_each returns after every task).
        let rows = unsafe {
            std::slice::from_raw_parts_mut(base.get().add(start), chunk.min(len - start))
        };
        f(t * per_task, rows)
    });
}

/// A raw output pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint regions, and the buffer outlives them (all join before it is read).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
