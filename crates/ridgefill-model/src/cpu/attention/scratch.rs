//! Each thread's attention buffers, kept across tasks and calls: a GQA group's stacked queries,
//! the scores (rows × keys: megabytes at long prompts), outputs and softmax parts.

use std::ops::Range;

use burn::backend::flex::FlexTensor;

#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::cpu::flex::heads4;

thread_local! {
    /// Each thread's attention buffers (scores are rows × keys: megabytes at long prompts).
    pub(super) static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// One attention task's buffers, kept per thread across tasks and calls.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(super) scores: Vec<f32>,
    /// A GQA group's query rows, stacked.
    pub(super) q: Vec<f32>,
    /// Their outputs, before they go to their heads' columns.
    pub(super) o: Vec<f32>,
    /// Keys seen by each stacked row.
    pub(super) live: Vec<usize>,
    /// The block kernel's softmax parts: a (largest score, sum) pair a stacked row, and each
    /// row's parts over the chunks, `split::slot_len` floats each.
    #[cfg(target_arch = "x86_64")]
    pub(super) stats: Vec<(f32, f32)>,
    #[cfg(target_arch = "x86_64")]
    pub(super) parts: Vec<f32>,
    /// The block kernel's buffers.
    #[cfg(target_arch = "x86_64")]
    pub(super) block: x86::BlockScratch,
}

impl Scratch {
    /// Stacks the query rows `rows` of heads `heads` of `q` (`[1, heads, n, hd]`), head-major,
    /// so a GQA group's heads meet their shared K/V head in one product.
    pub(super) fn stack_queries(
        &mut self,
        q: &FlexTensor,
        heads: Range<usize>,
        rows: Range<usize>,
    ) {
        let hd = q.layout().shape()[3];
        let (qs, q_head, q_row) = heads4(q);
        self.q.clear();
        for h in heads {
            for i in rows.clone() {
                self.q
                    .extend_from_slice(&qs[h * q_head + i * q_row as usize..][..hd]);
            }
        }
    }
}
