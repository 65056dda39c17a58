//! The pipe's payload: the LWIO negotiate request (the client's RDMA
//! providers) and response (the providers both share, a fresh server Key,
//! and the server's addresses to connect to).
//!
//! The side channel carries the packets of docs/protocol.md §2.6/§2.7 as
//! opaque bytes ([`Request::Negotiate`], [`Response::Negotiated`]); the
//! layouts and the provider intersection are `lwio-proto`'s
//! ([`lwio_proto::sidechannel`]). This module adds the glue: error mapping
//! (addresses and transports are [`lwio_proto::transport`]).
//!
//! [`Request::Negotiate`]: crate::codec::Request::Negotiate
//! [`Response::Negotiated`]: crate::codec::Response::Negotiated

pub use lwio_proto::wire::{
    AddressBlockRepr, Guid, NegotiateRequestRepr, NegotiateResponseRepr, NetAddressRepr,
};

use lwio_proto::transport::{self, Instance};

use crate::error::{Error, ErrorCode};

fn wire_err(what: &str, e: lwio_proto::wire::Error) -> Error {
    Error::new(ErrorCode::BadRequest, format!("{what}: {e}"))
}

/// Encode a negotiate request packet.
pub fn encode_request(req: &NegotiateRequestRepr) -> Result<Vec<u8>, Error> {
    req.to_bytes().map_err(|e| {
        Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "negotiate request cannot be encoded (name too long or too many providers): {e}"
            ),
        )
    })
}

/// Parse a negotiate request packet (server side).
pub fn decode_request(b: &[u8]) -> Result<NegotiateRequestRepr, Error> {
    lwio_proto::sidechannel::parse_negotiate_request(b)
        .map_err(|e| wire_err("negotiate request", e))
}

/// Server side: the response to `req` — the server's instances that share
/// a wire transport (and its policies) with one of the client's, trimmed
/// to the client's ResponseLength — and its bytes. Nothing in common is an
/// error naming the transports of both sides (`ErrorCode::Unsupported`).
pub fn build_response(
    req: &NegotiateRequestRepr,
    server_name: &str,
    key: Guid,
    server: &[Instance],
) -> Result<(NegotiateResponseRepr, Vec<u8>), Error> {
    let (resp, bytes) =
        lwio_proto::sidechannel::build_negotiate_response(req, server_name, key, server)
            .map_err(|e| wire_err("negotiate request (ResponseLength too small?)", e))?;
    if resp.providers.is_empty() {
        let client = transport::from_blocks(&req.providers);
        return Err(Error::new(
            ErrorCode::Unsupported,
            format!(
                "{NO_COMMON_TRANSPORT}: the client offers {}, the server offers {}",
                transport::describe(&client, false),
                transport::describe(server, true)
            ),
        ));
    }
    Ok((resp, bytes))
}

/// How a negotiate refusal for want of a common transport begins.
pub const NO_COMMON_TRANSPORT: &str = "no RDMA transport in common";

/// Parse a negotiate response packet (client side).
pub fn decode_response(b: &[u8]) -> Result<NegotiateResponseRepr, Error> {
    lwio_proto::sidechannel::parse_negotiate_response(b)
        .map_err(|e| wire_err("negotiate response", e))
}

/// A fresh random GUID (RFC 4122 version 4) for the server Key.
pub fn random_guid() -> Guid {
    let mut b = [0u8; 16];
    crate::random_bytes(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Guid::from_u128(u128::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_response() {
        use lwio_proto::transport::WireTransport::{Iwarp, RoceV2};
        let i = |t, a: &str| Instance::new(t, a.parse().unwrap());
        let req = NegotiateRequestRepr {
            client_name: "app1".into(),
            key: random_guid(),
            response_length: 4096,
            providers: transport::to_blocks(&[i(Iwarp, "10.0.0.2:0")]),
        };
        let b = encode_request(&req).unwrap();
        assert_eq!(&b[..4], b"LWIO");
        assert_eq!(decode_request(&b).unwrap(), req);
        let server = vec![i(Iwarp, "10.0.0.1:7471"), i(RoceV2, "10.0.0.1:7472")];
        let key = random_guid();
        let (resp, bytes) = build_response(&req, "stor1", key, &server).unwrap();
        assert_eq!(transport::from_blocks(&resp.providers), vec![server[0]]);
        assert_eq!(decode_response(&bytes).unwrap(), resp);
        assert_eq!(resp.key, key);
        assert_ne!(random_guid(), random_guid());
        assert!(decode_request(&b[..20]).is_err());
        // A RoCE-only server and an iWARP client: one line naming both sides.
        let e = build_response(&req, "stor1", key, &server[1..]).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unsupported);
        assert_eq!(
            e.message,
            "no RDMA transport in common: the client offers iWARP, the server offers RoCEv2 at 10.0.0.1:7472"
        );
    }
}
