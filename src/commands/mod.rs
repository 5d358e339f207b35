pub mod bench;
pub mod common;
pub mod fetch;
pub mod generate;
pub mod info;
pub mod score;
