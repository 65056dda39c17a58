//! Helpers shared by the integration tests (each test file compiles its own
//! copy, so a helper one file does not use is not dead code).
#![allow(dead_code)]

pub mod hostile;
pub mod malicious;
pub mod reconnect;
