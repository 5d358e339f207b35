//! Greedy decoding through the cache, as the golden continuations were made.

use ridgefill_model::sample::argmax;
use ridgefill_model::{Decoder, to_host_f32};

/// `n` greedy tokens after `prompt`: one prefill, then a decode step per token.
pub fn greedy(model: &Decoder, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache(prompt.len() + n);
    let mut logits = to_host_f32(model.prefill(prompt, &mut cache).unwrap());
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let next = argmax(&logits);
        ids.push(next);
        logits = to_host_f32(model.decode_step(next, &mut cache).unwrap());
    }
    ids
}
