//! Side-channel helpers: resume key request, negotiate request/response and
//! the server's answer (docs/protocol.md §2; transports: §2.8).

use crate::transport::{self, Instance};
use crate::wire::control::NEGOTIATE_FIXED_LEN;
use crate::wire::{
    AddressBlockRepr, Error, Guid, NegotiateRequestRepr, NegotiateResponseRepr,
    RequestResumeKeyPacket, RequestResumeKeyRepr, Result, SrvResumeKey,
};

/// Build an SRV_REQUEST_RESUME_KEY whose Context is `server_name` (UNC,
/// UTF-16LE, no terminator).
pub fn build_request_resume_key(key: SrvResumeKey, server_name: &str) -> Result<Vec<u8>> {
    RequestResumeKeyRepr {
        key,
        server_name: server_name.to_string(),
    }
    .to_bytes()
}

/// Parse an SRV_REQUEST_RESUME_KEY.
pub fn parse_request_resume_key(buf: &[u8]) -> Result<RequestResumeKeyRepr> {
    RequestResumeKeyRepr::parse(&RequestResumeKeyPacket::new_checked(buf)?)
}

/// Build a negotiate request.
pub fn build_negotiate_request(
    client_name: &str,
    key: Guid,
    response_length: u16,
    providers: &[AddressBlockRepr],
) -> Result<Vec<u8>> {
    NegotiateRequestRepr {
        client_name: client_name.to_string(),
        key,
        response_length,
        providers: providers.to_vec(),
    }
    .to_bytes()
}

/// Parse a negotiate request.
pub fn parse_negotiate_request(buf: &[u8]) -> Result<NegotiateRequestRepr> {
    NegotiateRequestRepr::parse(buf)
}

/// Parse a negotiate response.
pub fn parse_negotiate_response(buf: &[u8]) -> Result<NegotiateResponseRepr> {
    NegotiateResponseRepr::parse(buf)
}

/// Server side: answer a negotiate request. The answer lists the server's
/// instances that are compatible with one of the client's
/// ([`transport::common_instances`]: same wire transport, both usable,
/// iWARP policies that meet), grouped by transport in the client's order,
/// and drops trailing instances that would not fit the client's
/// ResponseLength. Fails with `Error::Malformed` if ResponseLength < 160.
/// An empty answer is the caller's to refuse (with both sides' transports).
pub fn build_negotiate_response(
    request: &NegotiateRequestRepr,
    server_name: &str,
    server_key: Guid,
    server: &[Instance],
) -> Result<(NegotiateResponseRepr, Vec<u8>)> {
    let max = usize::from(request.response_length);
    if max < NEGOTIATE_FIXED_LEN {
        return Err(Error::Malformed);
    }
    let client = transport::from_blocks(&request.providers);
    let mut common = transport::common_instances(&client, server);
    while !common.is_empty()
        && NEGOTIATE_FIXED_LEN
            + transport::to_blocks(&common)
                .iter()
                .map(|b| b.buffer_len())
                .sum::<usize>()
            > max
    {
        common.pop();
    }
    let resp = NegotiateResponseRepr {
        server_name: server_name.to_string(),
        key: server_key,
        providers: transport::to_blocks(&common),
    };
    let bytes = resp.to_bytes()?;
    Ok((resp, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_key_context_is_server_name() {
        let k = SrvResumeKey {
            resume_key: 1,
            timestamp: 2,
            pid: 3,
        };
        let b = build_request_resume_key(k, "\\\\srv").unwrap();
        assert_eq!(b.len(), 26 + 10);
        let r = parse_request_resume_key(&b).unwrap();
        assert_eq!(r.key, k);
        assert_eq!(r.server_name, "\\\\srv");
        assert!(parse_request_resume_key(&b[..30]).is_err());
    }

    #[test]
    fn negotiate_round_trip_and_truncation() {
        use crate::transport::WireTransport::{Iwarp, RoceV2};
        let i = |t, a: &str| Instance::new(t, a.parse().unwrap());
        let c = transport::to_blocks(&[i(RoceV2, "10.0.0.9:0"), i(Iwarp, "10.0.0.9:0")]);
        let key = Guid::from_u128(0x00112233_4455_6677_8899_aabbccddeeff);
        let req_bytes = build_negotiate_request("app1", key, 4096, &c).unwrap();
        let req = parse_negotiate_request(&req_bytes).unwrap();
        assert_eq!(req.client_name, "app1");
        assert_eq!(req.providers, c);
        let s = vec![
            i(Iwarp, "10.0.0.2:7421"),
            i(RoceV2, "10.0.0.1:7422"),
            i(Iwarp, "10.0.0.3:7423"),
        ];
        let skey = Guid::from_u128(42);
        let (resp, bytes) = build_negotiate_response(&req, "srv", skey, &s).unwrap();
        let parsed = parse_negotiate_response(&bytes).unwrap();
        assert_eq!(parsed, resp);
        // the client's order: RoCE first, then both iWARP instances
        assert_eq!(
            transport::from_blocks(&parsed.providers),
            vec![s[1], s[0], s[2]]
        );
        assert_eq!(parsed.providers[0].name, "rocev2");
        // A small ResponseLength keeps only what fits: one block, one instance.
        let mut small = req.clone();
        small.response_length = (160 + 66 + 4 + 4 + 8) as u16;
        let (resp, bytes) = build_negotiate_response(&small, "srv", skey, &s).unwrap();
        assert_eq!(transport::from_blocks(&resp.providers), vec![s[1]]);
        assert!(bytes.len() <= usize::from(small.response_length));
        small.response_length = 100;
        assert!(build_negotiate_response(&small, "srv", skey, &s).is_err());
        // nothing in common: an empty answer
        let roce_only = transport::to_blocks(&[i(RoceV2, "10.0.0.9:0")]);
        let req2 = parse_negotiate_request(
            &build_negotiate_request("app2", key, 4096, &roce_only).unwrap(),
        )
        .unwrap();
        let (resp, _) = build_negotiate_response(&req2, "srv", skey, &[s[0]]).unwrap();
        assert!(resp.providers.is_empty());
    }
}
