//! The soft provider's receive engine (the code the soft QPs run): traffic,
//! framing, indicate window and a schedule of delivery and receive posting
//! chosen by the input; exact data where nothing was corrupted, no panic
//! and no stray write (AddressSanitizer) where something was. See
//! crates/rdma/src/soft/fuzzing.rs.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lwio_rdma::soft::fuzzing::soft_qp_rx(data);
});
