#![no_main]
//! The lwio side-channel codec: no input panics the decoder, and whatever
//! decodes re-encodes to bytes that decode to the same message.
use libfuzzer_sys::fuzz_target;
use lwio_side::codec::{Request, Response};

fuzz_target!(|data: &[u8]| {
    if let Ok((id, req)) = Request::decode(data) {
        let again = Request::decode(&req.encode(id)).expect("re-encoded request decodes");
        assert_eq!(again, (id, req));
    }
    if let Ok((id, resp)) = Response::decode(data) {
        let again = Response::decode(&resp.encode(id)).expect("re-encoded response decodes");
        assert_eq!(again, (id, resp));
    }
});
