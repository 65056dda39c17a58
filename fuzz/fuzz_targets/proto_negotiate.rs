#![no_main]
//! Side-channel parsers: negotiate request/response, SRV_REQUEST_RESUME_KEY,
//! control header, and the server's negotiate answer.
use libfuzzer_sys::fuzz_target;
use lwio_proto::sidechannel::*;
use lwio_proto::transport;
use lwio_proto::wire::control::NegotiatePacket;
use lwio_proto::wire::{ControlHeaderPacket, ControlHeaderRepr, Guid};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = ControlHeaderPacket::new_checked(data) {
        let _ = ControlHeaderRepr::parse(&h);
    }
    if let Ok(p) = NegotiatePacket::new_checked(data) {
        for b in p.providers() {
            if let Ok(b) = b {
                let _ = b.name();
                for i in b.instances().flatten() {
                    let _ = (i.host_address(), i.discriminator());
                }
            }
        }
    }
    if let Ok(req) = parse_negotiate_request(data) {
        let again = req.to_bytes().expect("re-emit");
        assert_eq!(parse_negotiate_request(&again).expect("reparse"), req);
        // The transport descriptors: whatever parses re-encodes to itself,
        // and the server's answer to itself never exceeds ResponseLength.
        let server = transport::from_blocks(&req.providers);
        for i in &server {
            let back = transport::Instance::from_net_address(i.transport, &i.net_address());
            assert_eq!(back, Some(*i));
        }
        if let Ok((resp, bytes)) = build_negotiate_response(&req, "srv", Guid::default(), &server) {
            assert!(bytes.len() <= usize::from(req.response_length));
            assert_eq!(parse_negotiate_response(&bytes).expect("response parses"), resp);
            for i in transport::from_blocks(&resp.providers) {
                assert!(server.contains(&i));
            }
        }
    }
    let _ = parse_negotiate_response(data);
    if let Ok(r) = parse_request_resume_key(data) {
        let b = r.to_bytes().expect("emit");
        assert_eq!(parse_request_resume_key(&b).expect("reparse"), r);
    }
});
