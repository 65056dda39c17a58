//! placeholder docs
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod wire;
