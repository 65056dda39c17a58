#![no_main]
//! LWIO_AUTH_PARAMS: view, options walk, signed-bytes extraction, signature
//! verification (HMAC-SHA256 and MD5) and round trip.
use libfuzzer_sys::fuzz_target;
use lwio_proto::wire::auth::AuthParamsPacket;
use lwio_proto::wire::AuthParamsRepr;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = AuthParamsPacket::new_checked(data) {
        let n = p.total_len().expect("checked");
        assert!(n <= data.len());
        for o in p.options() {
            assert!(o.offset + 2 + o.data.len() <= n);
        }
        let _ = p.signed_bytes();
        if let Ok(r) = AuthParamsRepr::parse(&p) {
            let b = r.to_bytes().expect("emit");
            assert_eq!(AuthParamsRepr::from_bytes(&b).expect("reparse"), r);
        }
    }
    let _ = AuthParamsRepr::verify(data, b"fuzz secret");
});
