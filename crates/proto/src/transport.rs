//! Transport descriptors: what an RDMA provider instance speaks on the wire,
//! carried in the negotiate request and response (docs/protocol.md §2.8).
//!
//! The seed lets each host list its RDMA providers, each with instances
//! and addresses, and the server answers with those both hosts share. lwio
//! names an address block after the **wire transport** it speaks
//! (`iwarp`, `rocev2`, `ib`), not after the implementation: the soft
//! provider and the kernel's siw both speak iWARP and interoperate, while
//! which one a host uses stays its own choice. Each instance's
//! `LWIO_NET_ADDRESS` holds the IP address in HostAddress and an 8-byte
//! descriptor in Discriminator: the port, whether the instance is usable
//! now, and for iWARP the MPA revision and the CRC and marker policies.
//!
//! A 2-byte Discriminator (the port alone) is the form of lwio before this
//! extension; it reads as a usable instance with default iWARP policies.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::wire::{AddressBlockRepr, NetAddressRepr};

/// The wire transport an instance speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireTransport {
    /// iWARP: RDMAP/DDP over MPA over TCP (RFC 5040/5041/5044/6581).
    Iwarp,
    /// RoCE v2: InfiniBand transport over UDP/IP.
    RoceV2,
    /// InfiniBand.
    Infiniband,
}

impl WireTransport {
    pub const ALL: [WireTransport; 3] = [
        WireTransport::Iwarp,
        WireTransport::RoceV2,
        WireTransport::Infiniband,
    ];

    /// The address block Name on the wire.
    pub fn wire_name(self) -> &'static str {
        match self {
            WireTransport::Iwarp => "iwarp",
            WireTransport::RoceV2 => "rocev2",
            WireTransport::Infiniband => "ib",
        }
    }

    /// The transport of an address block Name (`soft` is the name lwio
    /// clients before this extension offered: the soft provider, iWARP).
    pub fn from_wire_name(name: &str) -> Option<WireTransport> {
        match name {
            "iwarp" | "soft" => Some(WireTransport::Iwarp),
            "rocev2" => Some(WireTransport::RoceV2),
            "ib" => Some(WireTransport::Infiniband),
            _ => None,
        }
    }
}

impl fmt::Display for WireTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WireTransport::Iwarp => "iWARP",
            WireTransport::RoceV2 => "RoCEv2",
            WireTransport::Infiniband => "InfiniBand",
        })
    }
}

/// MPA CRC32c policy of an iWARP instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrcPolicy {
    /// Never uses CRC (refuses a peer that requires it).
    Never,
    /// Uses CRC when the peer asks, works without.
    #[default]
    Optional,
    /// Only with CRC.
    Required,
}

/// Version of the 8-byte descriptor.
pub const DESCRIPTOR_VERSION: u8 = 1;
/// Length of the extended Discriminator.
pub const DESCRIPTOR_LEN: usize = 8;

const F_USABLE: u8 = 1 << 0;
const F_CRC_CAPABLE: u8 = 1 << 1;
const F_CRC_REQUIRED: u8 = 1 << 2;
const F_MARKERS_REQUIRED: u8 = 1 << 3;

/// One provider instance as negotiate carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instance {
    pub transport: WireTransport,
    /// Where it listens (server) or the local address it would use (client;
    /// port 0). An unspecified address in a server's answer means "the side
    /// channel's host".
    pub addr: SocketAddr,
    /// Usable now (device up, provider loaded).
    pub usable: bool,
    /// iWARP: the highest MPA revision spoken (1 or 2); 0 otherwise.
    pub mpa_rev: u8,
    /// iWARP: CRC policy.
    pub crc: CrcPolicy,
    /// iWARP: requires MPA markers (lwio's instances never do).
    pub markers: bool,
}

impl Instance {
    /// A usable instance with lwio's iWARP policies (MPA revision 2, CRC
    /// optional, no markers) or, for other transports, none.
    pub fn new(transport: WireTransport, addr: SocketAddr) -> Instance {
        let iwarp = transport == WireTransport::Iwarp;
        Instance {
            transport,
            addr,
            usable: true,
            mpa_rev: if iwarp { 2 } else { 0 },
            crc: CrcPolicy::Optional,
            markers: false,
        }
    }

    /// The instance's LWIO_NET_ADDRESS (extended Discriminator).
    pub fn net_address(&self) -> NetAddressRepr {
        let host_address = match self.addr.ip() {
            IpAddr::V4(v) => v.octets().to_vec(),
            IpAddr::V6(v) => v.octets().to_vec(),
        };
        let mut flags = 0;
        if self.usable {
            flags |= F_USABLE;
        }
        if self.transport == WireTransport::Iwarp {
            match self.crc {
                CrcPolicy::Never => {}
                CrcPolicy::Optional => flags |= F_CRC_CAPABLE,
                CrcPolicy::Required => flags |= F_CRC_CAPABLE | F_CRC_REQUIRED,
            }
            if self.markers {
                flags |= F_MARKERS_REQUIRED;
            }
        }
        let mut d = [0u8; DESCRIPTOR_LEN];
        d[..2].copy_from_slice(&self.addr.port().to_le_bytes());
        d[2] = DESCRIPTOR_VERSION;
        d[3] = flags;
        d[4] = if self.transport == WireTransport::Iwarp {
            self.mpa_rev
        } else {
            0
        };
        NetAddressRepr {
            host_address,
            discriminator: d.to_vec(),
        }
    }

    /// Read an instance of `transport` from its LWIO_NET_ADDRESS; `None`
    /// when the address is not an IP endpoint in one of the two known
    /// forms (2-byte port, or the 8-byte descriptor of a known version).
    pub fn from_net_address(transport: WireTransport, n: &NetAddressRepr) -> Option<Instance> {
        let ip = match n.host_address.len() {
            4 => IpAddr::V4(Ipv4Addr::from(
                <[u8; 4]>::try_from(&n.host_address[..]).ok()?,
            )),
            16 => IpAddr::V6(Ipv6Addr::from(
                <[u8; 16]>::try_from(&n.host_address[..]).ok()?,
            )),
            _ => return None,
        };
        let d = &n.discriminator;
        let port = u16::from_le_bytes(d.get(..2)?.try_into().ok()?);
        let mut inst = Instance::new(transport, SocketAddr::new(ip, port));
        match d.len() {
            2 => Some(inst),
            DESCRIPTOR_LEN if d[2] == DESCRIPTOR_VERSION => {
                let flags = d[3];
                inst.usable = flags & F_USABLE != 0;
                if transport == WireTransport::Iwarp {
                    inst.crc = if flags & F_CRC_REQUIRED != 0 {
                        CrcPolicy::Required
                    } else if flags & F_CRC_CAPABLE != 0 {
                        CrcPolicy::Optional
                    } else {
                        CrcPolicy::Never
                    };
                    inst.markers = flags & F_MARKERS_REQUIRED != 0;
                    inst.mpa_rev = d[4];
                }
                Some(inst)
            }
            _ => None,
        }
    }

    /// Whether a connection between `self` and `peer` can work: the same
    /// transport, both usable, and for iWARP an MPA revision on both sides,
    /// CRC policies that meet, and no markers (lwio does not do them).
    pub fn compatible(&self, peer: &Instance) -> Result<(), Mismatch> {
        if self.transport != peer.transport {
            return Err(Mismatch::Transport);
        }
        if !self.usable || !peer.usable {
            return Err(Mismatch::Unusable);
        }
        if self.transport == WireTransport::Iwarp {
            if self.mpa_rev == 0 || peer.mpa_rev == 0 {
                return Err(Mismatch::MpaRevision);
            }
            if self.markers || peer.markers {
                return Err(Mismatch::Markers);
            }
            use CrcPolicy::*;
            if matches!((self.crc, peer.crc), (Never, Required) | (Required, Never)) {
                return Err(Mismatch::Crc);
            }
        }
        Ok(())
    }
}

impl fmt::Display for Instance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}", self.transport, self.addr)?;
        if !self.usable {
            f.write_str(" (not usable)")?;
        }
        Ok(())
    }
}

/// Why two instances cannot talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    Transport,
    Unusable,
    MpaRevision,
    Markers,
    Crc,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mismatch::Transport => "different wire transports",
            Mismatch::Unusable => "an instance is not usable now",
            Mismatch::MpaRevision => "no MPA revision in common",
            Mismatch::Markers => "MPA markers required (lwio does not use markers)",
            Mismatch::Crc => "MPA CRC required on one side and refused on the other",
        })
    }
}

/// Address blocks for `instances`: one block per transport, named after
/// it, in the order the transports first appear.
pub fn to_blocks(instances: &[Instance]) -> Vec<AddressBlockRepr> {
    let mut out: Vec<AddressBlockRepr> = Vec::new();
    for i in instances {
        let name = i.transport.wire_name();
        match out.iter_mut().find(|b| b.name == name) {
            Some(b) => b.instances.push(i.net_address()),
            None => out.push(AddressBlockRepr {
                name: name.to_string(),
                instances: vec![i.net_address()],
            }),
        }
    }
    out
}

/// The instances of address blocks; blocks of unknown transports and
/// addresses of unknown forms are skipped (a newer peer may offer more).
/// A block of a known transport with no instances reads as one usable
/// instance at the unspecified address (a client that names a transport
/// without addresses, as lwio clients did before the descriptors).
pub fn from_blocks(blocks: &[AddressBlockRepr]) -> Vec<Instance> {
    let mut out = Vec::new();
    for b in blocks {
        let Some(t) = WireTransport::from_wire_name(&b.name) else {
            continue;
        };
        if b.instances.is_empty() {
            // "I speak this transport", with no address to give: the form
            // lwio clients before the descriptors sent (`soft`).
            let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
            out.push(Instance::new(t, any));
            continue;
        }
        out.extend(
            b.instances
                .iter()
                .filter_map(|n| Instance::from_net_address(t, n)),
        );
    }
    out
}

/// Server side: the server instances to offer a client — those compatible
/// with at least one of the client's, in the order of the client's
/// transports (its preference), each once.
pub fn common_instances(client: &[Instance], server: &[Instance]) -> Vec<Instance> {
    let mut out: Vec<Instance> = Vec::new();
    for c in client {
        for s in server {
            if s.compatible(c).is_ok() && !out.contains(s) {
                out.push(*s);
            }
        }
    }
    out
}

/// "iWARP, RoCEv2 at 10.0.0.1:7422": the transports of `instances` for a
/// one-line error (each transport once; addresses of server instances).
pub fn describe(instances: &[Instance], with_addresses: bool) -> String {
    if instances.is_empty() {
        return "nothing".into();
    }
    let mut parts: Vec<String> = Vec::new();
    for i in instances {
        let s = if with_addresses {
            i.to_string()
        } else if i.usable {
            i.transport.to_string()
        } else {
            format!("{} (not usable)", i.transport)
        };
        if !parts.contains(&s) {
            parts.push(s);
        }
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(t: WireTransport, a: &str) -> Instance {
        Instance::new(t, a.parse().unwrap())
    }

    #[test]
    fn descriptor_round_trip_every_field() {
        for t in WireTransport::ALL {
            for usable in [false, true] {
                for crc in [CrcPolicy::Never, CrcPolicy::Optional, CrcPolicy::Required] {
                    let mut i = inst(t, "[fe80::1]:7421");
                    i.usable = usable;
                    if t == WireTransport::Iwarp {
                        i.crc = crc;
                        i.mpa_rev = 1;
                        i.markers = usable;
                    }
                    let n = i.net_address();
                    assert_eq!(n.discriminator.len(), DESCRIPTOR_LEN);
                    assert_eq!(Instance::from_net_address(t, &n), Some(i));
                }
            }
        }
    }

    #[test]
    fn golden_descriptor_bytes() {
        let i = inst(WireTransport::Iwarp, "10.0.0.2:7421");
        let n = i.net_address();
        assert_eq!(n.host_address, [10, 0, 0, 2]);
        // port 7421 LE, version 1, usable|crc-capable, MPA rev 2, reserved
        assert_eq!(n.discriminator, [0xfd, 0x1c, 1, 0x03, 2, 0, 0, 0]);
        let r = inst(WireTransport::RoceV2, "10.0.0.1:7422").net_address();
        assert_eq!(r.discriminator, [0xfe, 0x1c, 1, 0x01, 0, 0, 0, 0]);
    }

    #[test]
    fn legacy_and_unknown_forms() {
        let legacy = NetAddressRepr {
            host_address: vec![127, 0, 0, 1],
            discriminator: 7421u16.to_le_bytes().to_vec(),
        };
        let i = Instance::from_net_address(WireTransport::Iwarp, &legacy).unwrap();
        assert_eq!(i, inst(WireTransport::Iwarp, "127.0.0.1:7421"));
        let mut future = inst(WireTransport::Iwarp, "127.0.0.1:1").net_address();
        future.discriminator[2] = 2;
        assert_eq!(
            Instance::from_net_address(WireTransport::Iwarp, &future),
            None
        );
        let odd = NetAddressRepr {
            host_address: vec![1, 2, 3],
            discriminator: vec![0, 0],
        };
        assert_eq!(Instance::from_net_address(WireTransport::Iwarp, &odd), None);
        let short = NetAddressRepr {
            host_address: vec![1, 2, 3, 4],
            discriminator: vec![0],
        };
        assert_eq!(
            Instance::from_net_address(WireTransport::Iwarp, &short),
            None
        );
    }

    #[test]
    fn every_pair_of_transports() {
        for a in WireTransport::ALL {
            for b in WireTransport::ALL {
                let r = inst(a, "10.0.0.1:0").compatible(&inst(b, "10.0.0.2:7421"));
                if a == b {
                    assert_eq!(r, Ok(()), "{a} with {b}");
                } else {
                    assert_eq!(r, Err(Mismatch::Transport), "{a} with {b}");
                }
            }
        }
    }

    #[test]
    fn unusable_and_iwarp_policies() {
        let a = inst(WireTransport::Iwarp, "10.0.0.1:0");
        let mut b = inst(WireTransport::Iwarp, "10.0.0.2:7421");
        b.usable = false;
        assert_eq!(a.compatible(&b), Err(Mismatch::Unusable));
        assert_eq!(b.compatible(&a), Err(Mismatch::Unusable));
        let mut b = inst(WireTransport::Iwarp, "10.0.0.2:7421");
        b.markers = true;
        assert_eq!(a.compatible(&b), Err(Mismatch::Markers));
        let mut b = inst(WireTransport::Iwarp, "10.0.0.2:7421");
        b.mpa_rev = 0;
        assert_eq!(a.compatible(&b), Err(Mismatch::MpaRevision));
        let (mut never, mut req) = (a, a);
        never.crc = CrcPolicy::Never;
        req.crc = CrcPolicy::Required;
        assert_eq!(never.compatible(&req), Err(Mismatch::Crc));
        assert_eq!(req.compatible(&never), Err(Mismatch::Crc));
        assert_eq!(req.compatible(&a), Ok(()));
        assert_eq!(never.compatible(&a), Ok(()));
        // RoCE ignores the iWARP-only fields.
        let mut r = inst(WireTransport::RoceV2, "10.0.0.1:0");
        r.crc = CrcPolicy::Never;
        let mut r2 = inst(WireTransport::RoceV2, "10.0.0.2:1");
        r2.crc = CrcPolicy::Required;
        assert_eq!(r.compatible(&r2), Ok(()));
    }

    #[test]
    fn blocks_group_by_transport_and_skip_unknown() {
        let v = vec![
            inst(WireTransport::Iwarp, "10.0.0.1:1"),
            inst(WireTransport::RoceV2, "10.0.0.1:2"),
            inst(WireTransport::Iwarp, "10.0.0.2:3"),
        ];
        let b = to_blocks(&v);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].name, "iwarp");
        assert_eq!(b[0].instances.len(), 2);
        assert_eq!(b[1].name, "rocev2");
        let mut with_unknown = b.clone();
        with_unknown.push(AddressBlockRepr {
            name: "verbs".into(),
            instances: vec![v[0].net_address()],
        });
        let back = from_blocks(&with_unknown);
        assert_eq!(back, vec![v[0], v[2], v[1]]);
        // an instance-less block of a known name: one unspecified instance
        let legacy = vec![AddressBlockRepr {
            name: "soft".into(),
            instances: vec![],
        }];
        assert_eq!(
            from_blocks(&legacy),
            vec![inst(WireTransport::Iwarp, "0.0.0.0:0")]
        );
    }

    #[test]
    fn server_answer_follows_client_order() {
        let server = vec![
            inst(WireTransport::RoceV2, "10.0.0.1:7422"),
            inst(WireTransport::Iwarp, "10.0.0.2:7421"),
            inst(WireTransport::Iwarp, "0.0.0.0:7423"),
        ];
        // soft-only client: iWARP only
        let soft = vec![inst(WireTransport::Iwarp, "10.0.0.9:0")];
        assert_eq!(common_instances(&soft, &server), vec![server[1], server[2]]);
        // a RoCE client and a soft client's iWARP, RoCE preferred
        let both = vec![
            inst(WireTransport::RoceV2, "10.0.0.9:0"),
            inst(WireTransport::Iwarp, "10.0.0.9:0"),
        ];
        assert_eq!(
            common_instances(&both, &server),
            vec![server[0], server[1], server[2]]
        );
        // RoCE server, soft client: nothing, and the error names both sides
        let roce_only = vec![server[0]];
        assert!(common_instances(&soft, &roce_only).is_empty());
        assert_eq!(describe(&soft, false), "iWARP");
        assert_eq!(describe(&roce_only, true), "RoCEv2 at 10.0.0.1:7422");
        // an unusable server instance is never offered
        let mut down = server[1];
        down.usable = false;
        assert!(common_instances(&soft, &[down]).is_empty());
    }
}
