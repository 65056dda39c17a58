//! placeholder docs
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fpdu_rx;
pub mod mpa;
pub mod rx;
pub mod tx;
pub mod wire;
