//! RidgeFill: fast LLM prefill by skipping upper layers for the bulk of the prompt and filling
//! their KV cache with ridge-fitted linear maps.
//!
//! This crate is the CLI and a facade over the workspace crates:
//! [`io`] (formats), [`model`] (burn models).

pub use ridgefill_io as io;
pub use ridgefill_model as model;

pub mod fetch;
pub mod fillfile;
pub mod interrupt;
pub mod resolve;
pub mod score;
pub mod session;
