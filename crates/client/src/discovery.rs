//! Discovery: which local provider instances to offer in negotiate, and
//! which path to take to the server afterwards (docs/protocol.md §2.8).
//!
//! The client offers, per wire transport, the instances its options allow
//! (`--provider auto`: every verbs device, then the soft provider; `verbs`:
//! the named or every verbs device; `soft`: the soft provider). The server
//! answers with its instances that share a transport and its policies with
//! one of them. The client then tries, in this order:
//!
//! 1. hardware (verbs) devices that **route to the server's address** — the
//!    kernel's route to that address leaves from one of the device's own
//!    addresses — not merely the first device on the list;
//! 2. the soft provider, where the server speaks iWARP.

use std::net::{IpAddr, SocketAddr};

use lwio_proto::transport::{Instance, WireTransport};
use lwio_rdma::{source_ip, DeviceInfo, Provider, ProviderChoice};

/// A local provider instance the client may use.
#[derive(Clone)]
pub struct Candidate {
    pub provider: Provider,
    pub device: DeviceInfo,
    /// What negotiate offers for it.
    pub instance: Instance,
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} ({})",
            self.provider.name(),
            self.device.name,
            self.instance
        )
    }
}

/// The local instances `choice` allows, in the client's preference order
/// (hardware first). `server_ip` (the side channel's peer) picks the
/// address offered for the soft provider.
pub fn local_candidates(
    choice: ProviderChoice,
    device: Option<&str>,
    server_ip: Option<IpAddr>,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (provider, dev) in lwio_rdma::devices_for(choice, device) {
        let Some(transport) = dev
            .transport
            .wire_name()
            .and_then(WireTransport::from_wire_name)
        else {
            continue;
        };
        let soft = provider.name() == "soft";
        let ip = if soft {
            server_ip.and_then(source_ip)
        } else {
            dev.addresses.first().copied()
        }
        .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        let mut instance = Instance::new(transport, SocketAddr::new(ip, 0));
        instance.usable = dev.usable.is_ok() && (soft || !dev.addresses.is_empty());
        out.push(Candidate {
            provider,
            device: dev,
            instance,
        });
    }
    out
}

/// Whether `c` can reach `addr`: the soft provider reaches whatever has a
/// route; a verbs device only addresses whose route leaves from one of its
/// own addresses.
pub fn reaches(c: &Candidate, addr: IpAddr) -> bool {
    match source_ip(addr) {
        None => false,
        Some(src) => c.provider.name() == "soft" || c.device.addresses.contains(&src),
    }
}

/// The paths to try, best first: (index into `cands`, server address).
/// A server instance on an unspecified address means the side channel's
/// host (`side_ip`).
pub fn paths(
    cands: &[Candidate],
    server: &[Instance],
    side_ip: Option<IpAddr>,
) -> Vec<(usize, SocketAddr)> {
    let mut out = Vec::new();
    for (ci, c) in cands.iter().enumerate() {
        for s in server {
            if c.instance.compatible(s).is_err() {
                continue;
            }
            let mut addr = s.addr;
            if addr.ip().is_unspecified() {
                match side_ip {
                    Some(ip) => addr.set_ip(ip),
                    None => continue,
                }
            }
            if !reaches(c, addr.ip()) {
                tracing::debug!(device = %c.device.name, %addr, "device does not route to the server's address");
                continue;
            }
            out.push((ci, addr));
        }
    }
    out
}

/// "iWARP (soft), RoCEv2 (rxe0, not usable)": the local side for a
/// one-line error.
pub fn describe_local(cands: &[Candidate]) -> String {
    if cands.is_empty() {
        return "nothing (no RDMA provider selected)".into();
    }
    cands
        .iter()
        .map(|c| {
            let what = if c.provider.name() == "soft" {
                "soft".to_string()
            } else {
                c.device.name.clone()
            };
            match &c.device.usable {
                Ok(()) => format!("{} ({what})", c.instance.transport),
                Err(_) => format!("{} ({what}, not usable)", c.instance.transport),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use lwio_rdma::Transport;

    fn cand(provider: &str, dev: &str, t: Transport, addrs: &[&str]) -> Candidate {
        let provider = lwio_rdma::provider(provider).unwrap();
        let device = DeviceInfo {
            provider: provider.name(),
            name: dev.into(),
            transport: t,
            addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            usable: Ok(()),
            caps: None,
        };
        let wt = WireTransport::from_wire_name(t.wire_name().unwrap()).unwrap();
        let ip = device
            .addresses
            .first()
            .copied()
            .unwrap_or("127.0.0.1".parse().unwrap());
        Candidate {
            provider,
            device,
            instance: Instance::new(wt, SocketAddr::new(ip, 0)),
        }
    }

    #[test]
    fn soft_reaches_loopback_and_hardware_only_its_own_route() {
        let soft = cand("soft", "soft0", Transport::Iwarp, &[]);
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert!(reaches(&soft, lo));
        // A "device" on a documentation address does not own the route to
        // loopback, so it is never picked for it.
        let nic = cand("verbs", "mlx5_0", Transport::Iwarp, &["192.0.2.7"]);
        assert!(!reaches(&nic, lo));
        let own = cand("verbs", "lo-rdma", Transport::Iwarp, &["127.0.0.1"]);
        assert!(reaches(&own, lo));
    }

    #[test]
    fn paths_prefer_routing_hardware_then_soft() {
        let srv = vec![
            Instance::new(WireTransport::Iwarp, "127.0.0.1:7421".parse().unwrap()),
            Instance::new(WireTransport::RoceV2, "127.0.0.1:7422".parse().unwrap()),
        ];
        let cands = vec![
            cand("verbs", "far0", Transport::Iwarp, &["192.0.2.7"]),
            cand("verbs", "near0", Transport::Roce, &["127.0.0.1"]),
            cand("soft", "soft0", Transport::Iwarp, &[]),
        ];
        let p = paths(&cands, &srv, None);
        // far0 does not route to 127.0.0.1; near0 takes the RoCE listener;
        // soft the iWARP one.
        assert_eq!(p, vec![(1, srv[1].addr), (2, srv[0].addr)]);
        // a wildcard server address means the side channel's host
        let wild = vec![Instance::new(
            WireTransport::Iwarp,
            "0.0.0.0:7421".parse().unwrap(),
        )];
        assert!(paths(&cands[2..], &wild, None).is_empty());
        assert_eq!(
            paths(&cands[2..], &wild, Some("127.0.0.1".parse().unwrap())),
            vec![(0, "127.0.0.1:7421".parse().unwrap())]
        );
        // RoCE server, soft client: nothing, and the error names both sides
        assert!(paths(&cands[2..], &srv[1..], None).is_empty());
        assert_eq!(describe_local(&cands[2..]), "iWARP (soft)");
    }
}
