#![no_main]
//! Fixed-size structures: status response, I/O status block, FID params,
//! RDMA region, resume key.
use libfuzzer_sys::fuzz_target;
use lwio_proto::wire::*;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = StatusResponse::from_bytes(data) {
        assert_eq!(&s.to_bytes()[..], data);
        let _ = (s.is_credit_delta(), s.credit_delta());
    }
    if let Ok(i) = IoStatusBlock::from_bytes(data) {
        assert_eq!(&i.to_bytes()[..], &data[..8]);
    }
    if let Ok(p) = FidParamsPacket::new_checked(data) {
        let _ = FidParamsRepr::parse(&p);
    }
    if let Ok(p) = RdmaRegionPacket::new_checked(data) {
        let _ = RdmaRegion::parse(&p);
    }
    if let Ok(p) = ResumeKeyPacket::new_checked(data) {
        let k = SrvResumeKey::parse(&p).expect("checked");
        assert_eq!(&k.to_bytes()[..], &data[..24]);
    }
});
