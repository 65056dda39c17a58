#![no_main]
//! The lwio side-channel codec: no input panics the decoder, and whatever
//! decodes re-encodes to bytes that decode to the same message. Requests
//! go through `Request::decode_as`, the server's own decoder (credentials
//! in the body header included).
use libfuzzer_sys::fuzz_target;
use lwio_side::codec::{Request, Response};

fuzz_target!(|data: &[u8]| {
    if let Ok((id, creds, req)) = Request::decode_as(data) {
        let again = Request::decode_as(&req.encode_as(id, creds.as_ref()))
            .expect("re-encoded request decodes");
        assert_eq!(again, (id, creds, req));
    }
    if let Ok((id, resp)) = Response::decode(data) {
        let again = Response::decode(&resp.encode(id)).expect("re-encoded response decodes");
        assert_eq!(again, (id, resp));
    }
});
