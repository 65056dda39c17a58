#![no_main]
//! Every client → server message parser: RequestRepr::parse, the zero-copy
//! RequestPacket accessors, and emit → parse round trip of what parses
//! (CANCEL's three forms included; seeds in corpus/proto_request).
use libfuzzer_sys::fuzz_target;
use lwio_proto::wire::{AuthParamsRepr, FidParamsRepr, RdmaRegion, RequestPacket, RequestRepr};

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = RequestPacket::new_checked(data) {
        let h = p.header();
        let _ = (h.length(), h.opcode(), h.flags(), h.cookie(), h.num_pages(), h.page_size());
        for r in p.regions() {
            let _ = RdmaRegion::parse(&r);
        }
        if let Ok(a) = p.auth_params() {
            let _ = AuthParamsRepr::parse(&a);
            let _ = a.signed_bytes();
        }
        if let Ok(f) = p.fid_params() {
            let _ = FidParamsRepr::parse(&f);
        }
    }
    // CANCEL (docs/protocol.md §5.9): DataVa 0 (whole Fid), 1 (by Cookie) or
    // 2 (by status block) selects the form; any other value is refused.
    if data.len() >= 32 && data[4] == 5 {
        let data_va = u64::from_le_bytes(data[24..32].try_into().expect("8 bytes"));
        if data_va > 2 {
            assert!(
                RequestRepr::parse(data).is_err(),
                "CANCEL with DataVa {data_va}"
            );
        }
    }
    if let Ok(r) = RequestRepr::parse(data) {
        let bytes = r.to_bytes().expect("parsed request re-emits");
        assert_eq!(bytes.len(), r.buffer_len());
        assert_eq!(RequestRepr::parse(&bytes).expect("re-parses"), r);
    }
});
