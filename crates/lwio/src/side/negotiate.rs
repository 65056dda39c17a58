//! The pipe's payload: the negotiate request (client's RDMA providers) and
//! response (providers both share, a fresh server Key, addresses to connect
//! to).
//!
//! The side channel carries these as opaque bytes ([`Request::Negotiate`],
//! [`Response::Negotiated`]). **Interim encoding**: until `lwio-proto`'s
//! `NegotiateRequestRepr`/`NegotiateResponseRepr` (the LWIO packet layout of
//! docs/protocol.md §2.6/2.7) are available, the payload uses the side
//! channel's own primitives (see docs/side-channel.md, "Negotiate payload").
//! Only [`encode_request`], [`decode_request`], [`encode_response`] and
//! [`decode_response`] know the layout; swapping them changes nothing else.
//!
//! [`Request::Negotiate`]: super::codec::Request::Negotiate
//! [`Response::Negotiated`]: super::codec::Response::Negotiated

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::codec::{DecodeError, R, W};

/// Format byte at the start of interim payloads.
pub const INTERIM_FORMAT: u8 = 0xa1;

/// LWIO_NET_ADDRESS: a host address and a discriminator, network specific.
/// For IP transports: 4 or 16 address bytes and a u16 LE port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetAddress {
    pub host: Vec<u8>,
    pub discriminator: Vec<u8>,
}

impl NetAddress {
    pub fn from_socket_addr(a: SocketAddr) -> NetAddress {
        let host = match a.ip() {
            IpAddr::V4(v) => v.octets().to_vec(),
            IpAddr::V6(v) => v.octets().to_vec(),
        };
        NetAddress {
            host,
            discriminator: a.port().to_le_bytes().to_vec(),
        }
    }

    /// The IP address and port, when the address has that shape.
    pub fn to_socket_addr(&self) -> Option<SocketAddr> {
        let port = u16::from_le_bytes(self.discriminator.as_slice().try_into().ok()?);
        let ip = match self.host.len() {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&self.host[..]).ok()?)),
            16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&self.host[..]).ok()?)),
            _ => return None,
        };
        Some(SocketAddr::new(ip, port))
    }
}

/// LwioAddressBlk_t: a provider name and its instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderAddrs {
    pub name: String,
    pub instances: Vec<NetAddress>,
}

/// Client → server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiateRequest {
    pub client_name: String,
    /// Client UUID.
    pub key: [u8; 16],
    pub providers: Vec<ProviderAddrs>,
}

/// Server → client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiateResponse {
    pub server_name: String,
    /// Fresh server-generated GUID; the client presents it in the RDMA AUTH.
    pub key: [u8; 16],
    /// Providers both sides have, with the server's addresses for each.
    pub providers: Vec<ProviderAddrs>,
}

/// Most providers / instances accepted in one message.
pub const MAX_PROVIDERS: usize = 64;

fn put_providers(w: &mut W, ps: &[ProviderAddrs]) {
    w.u32(ps.len().min(MAX_PROVIDERS) as u32);
    for p in ps.iter().take(MAX_PROVIDERS) {
        w.str(&p.name);
        w.u32(p.instances.len().min(MAX_PROVIDERS) as u32);
        for i in p.instances.iter().take(MAX_PROVIDERS) {
            w.bytes(&i.host);
            w.bytes(&i.discriminator);
        }
    }
}

fn get_providers(r: &mut R<'_>) -> Result<Vec<ProviderAddrs>, DecodeError> {
    let n = r.count(6)?;
    if n > MAX_PROVIDERS {
        return Err(DecodeError("too many providers"));
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str()?;
        let m = r.count(8)?;
        if m > MAX_PROVIDERS {
            return Err(DecodeError("too many provider instances"));
        }
        let mut instances = Vec::with_capacity(m);
        for _ in 0..m {
            instances.push(NetAddress {
                host: r.bytes()?,
                discriminator: r.bytes()?,
            });
        }
        v.push(ProviderAddrs { name, instances });
    }
    Ok(v)
}

fn encode(name: &str, key: &[u8; 16], providers: &[ProviderAddrs]) -> Vec<u8> {
    let mut w = W::default();
    w.u8(INTERIM_FORMAT);
    w.str(name);
    w.raw(key);
    put_providers(&mut w, providers);
    w.0
}

fn decode(b: &[u8]) -> Result<(String, [u8; 16], Vec<ProviderAddrs>), DecodeError> {
    let mut r = R { b };
    if r.u8()? != INTERIM_FORMAT {
        return Err(DecodeError("unknown negotiate payload format"));
    }
    let name = r.str()?;
    let key = r.arr()?;
    let providers = get_providers(&mut r)?;
    r.end()?;
    Ok((name, key, providers))
}

pub fn encode_request(req: &NegotiateRequest) -> Vec<u8> {
    encode(&req.client_name, &req.key, &req.providers)
}

pub fn decode_request(b: &[u8]) -> Result<NegotiateRequest, DecodeError> {
    let (client_name, key, providers) = decode(b)?;
    Ok(NegotiateRequest {
        client_name,
        key,
        providers,
    })
}

pub fn encode_response(resp: &NegotiateResponse) -> Vec<u8> {
    encode(&resp.server_name, &resp.key, &resp.providers)
}

pub fn decode_response(b: &[u8]) -> Result<NegotiateResponse, DecodeError> {
    let (server_name, key, providers) = decode(b)?;
    Ok(NegotiateResponse {
        server_name,
        key,
        providers,
    })
}

/// The server's providers that the client also has (names compared
/// case-insensitively, as the seed asks both sides to use the same names),
/// with the server's addresses, in the server's order.
pub fn common_providers(server: &[ProviderAddrs], client: &[ProviderAddrs]) -> Vec<ProviderAddrs> {
    server
        .iter()
        .filter(|s| client.iter().any(|c| c.name.eq_ignore_ascii_case(&s.name)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, addrs: &[&str]) -> ProviderAddrs {
        ProviderAddrs {
            name: name.into(),
            instances: addrs
                .iter()
                .map(|a| NetAddress::from_socket_addr(a.parse().unwrap()))
                .collect(),
        }
    }

    #[test]
    fn round_trip_and_golden() {
        let req = NegotiateRequest {
            client_name: "c".into(),
            key: [1; 16],
            providers: vec![p("soft", &["10.0.0.1:7471"])],
        };
        let b = encode_request(&req);
        let mut want = vec![INTERIM_FORMAT, 1, 0, b'c'];
        want.extend_from_slice(&[1; 16]);
        want.extend_from_slice(&[1, 0, 0, 0, 4, 0, b's', b'o', b'f', b't', 1, 0, 0, 0]);
        want.extend_from_slice(&[4, 0, 0, 0, 10, 0, 0, 1, 2, 0, 0, 0, 0x2f, 0x1d]);
        assert_eq!(b, want);
        assert_eq!(decode_request(&b).unwrap(), req);
        for n in 0..b.len() {
            assert!(decode_request(&b[..n]).is_err());
        }
    }

    #[test]
    fn addresses() {
        for a in ["10.1.2.3:7471", "[fe80::1]:9"] {
            let sa: SocketAddr = a.parse().unwrap();
            assert_eq!(NetAddress::from_socket_addr(sa).to_socket_addr(), Some(sa));
        }
        assert_eq!(
            NetAddress {
                host: vec![1],
                discriminator: vec![0, 0]
            }
            .to_socket_addr(),
            None
        );
    }

    #[test]
    fn common() {
        let server = vec![p("verbs", &["10.0.0.1:1"]), p("soft", &["10.0.0.1:2"])];
        let client = vec![p("SOFT", &[]), p("other", &[])];
        let c = common_providers(&server, &client);
        assert_eq!(c, vec![p("soft", &["10.0.0.1:2"])]);
        assert!(common_providers(&server, &[]).is_empty());
    }
}
