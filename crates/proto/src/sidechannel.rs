//! Side-channel helpers: resume key request, negotiate request/response and
//! provider intersection (docs/protocol.md §2).

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

/// Providers common to client and server: equal names; client order; each
/// name once; the server's instance table; server entries without
/// instances are skipped.
pub fn common_providers(
    client: &[AddressBlockRepr],
    server: &[AddressBlockRepr],
) -> Vec<AddressBlockRepr> {
    let mut out: Vec<AddressBlockRepr> = Vec::new();
    for c in client {
        if out.iter().any(|o| o.name == c.name) {
            continue;
        }
        if let Some(s) = server
            .iter()
            .find(|s| s.name == c.name && !s.instances.is_empty())
        {
            out.push(s.clone());
        }
    }
    out
}

/// Server side: answer a negotiate request. Computes the common providers
/// and drops trailing ones that would not fit the client's ResponseLength.
/// Fails with `Error::Malformed` if ResponseLength < 160.
pub fn build_negotiate_response(
    request: &NegotiateRequestRepr,
    server_name: &str,
    server_key: Guid,
    server_providers: &[AddressBlockRepr],
) -> Result<(NegotiateResponseRepr, Vec<u8>)> {
    let max = usize::from(request.response_length);
    if max < NEGOTIATE_FIXED_LEN {
        return Err(Error::Malformed);
    }
    let mut providers = common_providers(&request.providers, server_providers);
    let mut len = NEGOTIATE_FIXED_LEN;
    let mut keep = 0;
    for p in &providers {
        if len + p.buffer_len() > max {
            break;
        }
        len += p.buffer_len();
        keep += 1;
    }
    providers.truncate(keep);
    let resp = NegotiateResponseRepr {
        server_name: server_name.to_string(),
        key: server_key,
        providers,
    };
    let bytes = resp.to_bytes()?;
    Ok((resp, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::NetAddressRepr;

    fn blk(name: &str, addrs: &[(&[u8], &[u8])]) -> AddressBlockRepr {
        AddressBlockRepr {
            name: name.into(),
            instances: addrs
                .iter()
                .map(|(h, d)| NetAddressRepr {
                    host_address: h.to_vec(),
                    discriminator: d.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn intersection_keeps_client_order_and_server_addresses() {
        let c = vec![
            blk("softiwarp", &[(&[127, 0, 0, 1], &[1, 0])]),
            blk("iwarp", &[(&[10, 0, 0, 1], &[2, 0])]),
            blk("ib", &[]),
            blk("iwarp", &[]),
        ];
        let s = vec![
            blk("iwarp", &[(&[10, 0, 0, 9], &[0x5c, 0x12])]),
            blk("softiwarp", &[(&[127, 0, 0, 2], &[0x5c, 0x12])]),
            blk("ib", &[]),
        ];
        let r = common_providers(&c, &s);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], s[1]);
        assert_eq!(r[1], s[0]);
        assert!(common_providers(&c, &[]).is_empty());
    }

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
        let c = vec![
            blk("iwarp", &[(&[1, 2, 3, 4], &[5, 6])]),
            blk("softiwarp", &[(&[9], &[])]),
        ];
        let key = Guid::from_u128(0x00112233_4455_6677_8899_aabbccddeeff);
        let req_bytes = build_negotiate_request("app1", key, 4096, &c).unwrap();
        let req = parse_negotiate_request(&req_bytes).unwrap();
        assert_eq!(req.client_name, "app1");
        assert_eq!(req.providers, c);
        let s = vec![
            blk("softiwarp", &[(&[7, 7, 7, 7], &[1])]),
            blk("iwarp", &[(&[8], &[9])]),
        ];
        let skey = Guid::from_u128(42);
        let (resp, bytes) = build_negotiate_response(&req, "srv", skey, &s).unwrap();
        let parsed = parse_negotiate_response(&bytes).unwrap();
        assert_eq!(parsed, resp);
        assert_eq!(parsed.providers.len(), 2);
        assert_eq!(parsed.providers[0].name, "iwarp");
        // A small ResponseLength keeps only what fits.
        let mut small = req.clone();
        small.response_length = (160 + 66 + 6) as u16;
        let (resp, bytes) = build_negotiate_response(&small, "srv", skey, &s).unwrap();
        assert_eq!(resp.providers.len(), 1);
        assert!(bytes.len() <= usize::from(small.response_length));
        small.response_length = 100;
        assert!(build_negotiate_response(&small, "srv", skey, &s).is_err());
    }
}
