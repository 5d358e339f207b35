pub mod bench;
pub mod common;
pub mod eval;
pub mod fetch;
pub mod fit;
pub mod generate;
pub mod info;
pub mod score;
