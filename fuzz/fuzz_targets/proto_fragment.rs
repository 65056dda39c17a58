#![no_main]
//! The fragment parser and reassembler (docs/protocol.md §5.12): a stream of
//! receive buffers, each either an LWIO_FRAGMENT or something else. Nothing
//! panics; every buffer handed in comes back (in a message, a refusal or an
//! abort); assembled messages are exactly as long as announced and their
//! bytes are the fragments' data in order; no receive memory stays reserved.
use libfuzzer_sys::fuzz_target;
use lwio_proto::fragment::{Budget, Reassembler};
use lwio_proto::wire::fragment::{FragmentPacket, FragmentRepr, FRAGMENT_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let budget = Budget::new(1 << 16);
    let mut r: Reassembler<Vec<u8>> = Reassembler::new(1 << 15, budget.clone());
    let (mut given, mut back) = (0usize, 0usize);
    // Buffers are separated by a length byte: [n][n bytes]...
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize).min(tail.len());
        let (buf, tail) = tail.split_at(n);
        rest = tail;
        let parsed = FragmentPacket::new_checked(buf)
            .ok()
            .and_then(|p| FragmentRepr::parse(&p).ok().map(|f| (f, p.data().len())));
        match parsed {
            Some((f, len)) => {
                given += 1;
                let range = FRAGMENT_HEADER_LEN..FRAGMENT_HEADER_LEN + len;
                match r.push(&f, buf.to_vec(), range) {
                    Ok(Some(m)) => {
                        let total: usize = m.parts.iter().map(|(_, r)| r.len()).sum();
                        assert_eq!(total, m.len as usize);
                        back += m.parts.len();
                    }
                    Ok(None) => {}
                    Err(e) => back += e.buffers.len(),
                }
            }
            // Another message before the LAST fragment: the partial goes.
            None => back += r.abort().len(),
        }
    }
    back += r.abort().len();
    assert_eq!(given, back);
    assert_eq!(budget.used(), 0);
});
