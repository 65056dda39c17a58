//! Admission control for new side-channel connections, decided right after
//! `accept` and before any byte is read or a task is spawned:
//!
//! * at most `limits.max_connections_per_host` concurrent connections from
//!   one host (authenticated or not);
//! * at most `limits.max_unauthenticated` connections that have not logged
//!   in yet, server-wide, and at most a small share of them from one host
//!   (`limits.max_unauthenticated_per_host`, by default a sixteenth, at
//!   least 4), so a few addresses cannot hold every login slot;
//! * new connections are rate-limited by two token buckets: one per host
//!   (`unauth_rate_per_host`/s, burst `unauth_burst_per_host`) and one
//!   global (`unauth_rate`/s, burst `unauth_burst`). A host over its own
//!   limits does not consume global tokens, so one flooding host cannot
//!   starve the others.
//!
//! A host is an IPv4 address, or an IPv6 /64 (one machine is commonly
//! given a whole /64, so counting IPv6 addresses alone would not bound it);
//! an IPv4-mapped IPv6 address counts as its IPv4 address.
//!
//! A refused connection is closed at once (after a best-effort, non-blocking
//! "busy" frame). See docs/security.md.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::Limits;

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    HostConnections,
    HostUnauthenticated,
    HostRate,
    Unauthenticated,
    GlobalRate,
}

impl Refusal {
    pub fn message(self) -> &'static str {
        match self {
            Refusal::HostConnections => "server busy: too many connections from your address",
            Refusal::HostUnauthenticated => {
                "server busy: too many connections from your address waiting to log in; retry later"
            }
            Refusal::HostRate => {
                "server busy: too many new connections from your address; retry later"
            }
            Refusal::Unauthenticated => {
                "server busy: too many connections waiting to log in; retry later"
            }
            Refusal::GlobalRate => "server busy: too many new connections; retry later",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn full(burst: u32, now: Instant) -> Bucket {
        Bucket {
            tokens: f64::from(burst),
            last: now,
        }
    }
    fn refill(&mut self, rate: u32, burst: u32, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * f64::from(rate)).min(f64::from(burst));
        self.last = now;
    }
    fn is_full(&self, burst: u32) -> bool {
        self.tokens >= f64::from(burst)
    }
}

#[derive(Debug)]
struct Host {
    conns: usize,
    /// Of them, not logged in yet.
    unauth: usize,
    bucket: Bucket,
}

#[derive(Debug)]
struct Inner {
    hosts: HashMap<IpAddr, Host>,
    global: Bucket,
    unauthenticated: usize,
}

/// Live counters of connection admission.
#[derive(Debug)]
pub struct Admission {
    inner: Mutex<Inner>,
    per_host: usize,
    per_host_unauth: usize,
    max_unauth: usize,
    host_rate: u32,
    host_burst: u32,
    rate: u32,
    burst: u32,
    refused: AtomicU64,
}

/// Prune idle host entries once the map is this large.
const PRUNE_AT: usize = 4096;

impl Admission {
    pub fn new(l: &Limits) -> Admission {
        let now = Instant::now();
        Admission {
            inner: Mutex::new(Inner {
                hosts: HashMap::new(),
                global: Bucket::full(l.unauth_burst, now),
                unauthenticated: 0,
            }),
            per_host: l.max_connections_per_host,
            per_host_unauth: l.unauthenticated_per_host(),
            max_unauth: l.max_unauthenticated,
            host_rate: l.unauth_rate_per_host,
            host_burst: l.unauth_burst_per_host,
            rate: l.unauth_rate,
            burst: l.unauth_burst,
            refused: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admit a new connection from `ip`, or say why not.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnGuard, Refusal> {
        let ip = host_key(ip);
        let now = Instant::now();
        let mut g = self.lock();
        let r = self.decide(&mut g, ip, now);
        if r.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        r?;
        Ok(ConnGuard {
            adm: self.clone(),
            ip,
            unauthenticated: true,
        })
    }

    fn decide(&self, g: &mut Inner, ip: IpAddr, now: Instant) -> Result<(), Refusal> {
        if g.hosts.len() >= PRUNE_AT && !g.hosts.contains_key(&ip) {
            let (rate, burst) = (self.host_rate, self.host_burst);
            g.hosts.retain(|_, h| {
                h.bucket.refill(rate, burst, now);
                h.conns > 0 || !h.bucket.is_full(burst)
            });
        }
        let host = g.hosts.entry(ip).or_insert_with(|| Host {
            conns: 0,
            unauth: 0,
            bucket: Bucket::full(self.host_burst, now),
        });
        if host.conns >= self.per_host {
            return Err(Refusal::HostConnections);
        }
        if host.unauth >= self.per_host_unauth {
            return Err(Refusal::HostUnauthenticated);
        }
        host.bucket.refill(self.host_rate, self.host_burst, now);
        if host.bucket.tokens < 1.0 {
            return Err(Refusal::HostRate);
        }
        if g.unauthenticated >= self.max_unauth {
            return Err(Refusal::Unauthenticated);
        }
        g.global.refill(self.rate, self.burst, now);
        if g.global.tokens < 1.0 {
            return Err(Refusal::GlobalRate);
        }
        g.global.tokens -= 1.0;
        g.unauthenticated += 1;
        let host = g.hosts.get_mut(&ip).expect("inserted above");
        host.bucket.tokens -= 1.0;
        host.conns += 1;
        host.unauth += 1;
        Ok(())
    }

    /// Concurrent connections from `ip`'s host (its /64 for IPv6).
    pub fn host_connections(&self, ip: IpAddr) -> usize {
        self.lock().hosts.get(&host_key(ip)).map_or(0, |h| h.conns)
    }

    /// Of them, not logged in yet.
    pub fn host_unauthenticated(&self, ip: IpAddr) -> usize {
        self.lock().hosts.get(&host_key(ip)).map_or(0, |h| h.unauth)
    }

    /// Connections that have not logged in.
    pub fn unauthenticated(&self) -> usize {
        self.lock().unauthenticated
    }

    /// Connections refused since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// The host an address counts as: IPv4 as is, IPv6 by its /64, an
/// IPv4-mapped IPv6 address as its IPv4 address.
pub fn host_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// Holds a connection's place; releases it on drop.
#[derive(Debug)]
pub struct ConnGuard {
    adm: Arc<Admission>,
    ip: IpAddr,
    unauthenticated: bool,
}

impl ConnGuard {
    /// The connection logged in: it no longer counts as unauthenticated.
    pub fn authenticated(&mut self) {
        if std::mem::take(&mut self.unauthenticated) {
            let mut g = self.adm.lock();
            g.unauthenticated = g.unauthenticated.saturating_sub(1);
            if let Some(h) = g.hosts.get_mut(&self.ip) {
                h.unauth = h.unauth.saturating_sub(1);
            }
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let mut g = self.adm.lock();
        if self.unauthenticated {
            g.unauthenticated = g.unauthenticated.saturating_sub(1);
        }
        if let Some(h) = g.hosts.get_mut(&self.ip) {
            h.conns = h.conns.saturating_sub(1);
            if self.unauthenticated {
                h.unauth = h.unauth.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_connections_per_host: 3,
            max_unauthenticated: 5,
            unauth_rate_per_host: 1,
            unauth_burst_per_host: 4,
            unauth_rate: 1,
            unauth_burst: 6,
            ..Limits::default()
        }
    }

    #[test]
    fn per_host_cap_and_release() {
        let a = Arc::new(Admission::new(&limits()));
        let h: IpAddr = "10.0.0.1".parse().unwrap();
        let g1 = a.admit(h).unwrap();
        let _g2 = a.admit(h).unwrap();
        let mut g3 = a.admit(h).unwrap();
        assert_eq!(a.admit(h).unwrap_err(), Refusal::HostConnections);
        assert_eq!(a.host_connections(h), 3);
        g3.authenticated();
        assert_eq!(a.unauthenticated(), 2);
        drop(g1);
        assert_eq!(a.host_connections(h), 2);
        // Capacity is back, and the bucket had 4 tokens: one left.
        let _g4 = a.admit(h).unwrap();
        drop(g3);
        assert_eq!(a.admit(h).unwrap_err(), Refusal::HostRate);
        assert_eq!(a.refused(), 2);
    }

    #[test]
    fn global_limits_and_fairness() {
        let a = Arc::new(Admission::new(&limits()));
        let flood: IpAddr = "10.0.0.2".parse().unwrap();
        let mut held = Vec::new();
        for _ in 0..100 {
            if let Ok(g) = a.admit(flood) {
                held.push(g);
            }
        }
        assert_eq!(held.len(), 3, "per-host cap");
        // The flood did not eat global tokens beyond what it was admitted.
        let mut others = Vec::new();
        for i in 0..2 {
            others.push(a.admit(IpAddr::from([10, 0, 1, i])).unwrap());
        }
        assert_eq!(a.unauthenticated(), 5);
        assert_eq!(
            a.admit("10.0.2.1".parse().unwrap()).unwrap_err(),
            Refusal::Unauthenticated
        );
        for g in &mut others {
            g.authenticated();
        }
        // 5 of 6 global tokens used; one left, then the global rate bites.
        let _x = a.admit("10.0.2.2".parse().unwrap()).unwrap();
        assert_eq!(
            a.admit("10.0.2.3".parse().unwrap()).unwrap_err(),
            Refusal::GlobalRate
        );
    }

    /// IPv6 clients are one host per /64 (a host is usually given a whole
    /// /64); IPv4 per address, an IPv4-mapped IPv6 address as its IPv4.
    #[test]
    fn ipv6_hosts_grouped_by_64() {
        let a = Arc::new(Admission::new(&limits()));
        let mut held = Vec::new();
        for i in 1..=3u16 {
            held.push(
                a.admit(IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, i]))
                    .unwrap(),
            );
        }
        assert_eq!(
            a.admit("2001:db8::ffff:1".parse().unwrap()).unwrap_err(),
            Refusal::HostConnections,
            "another address of the same /64"
        );
        assert_eq!(a.host_connections("2001:db8::9".parse().unwrap()), 3);
        let _other = a.admit("2001:db8:0:1::1".parse().unwrap()).unwrap();
        let v4: IpAddr = "10.9.9.9".parse().unwrap();
        let _g = a.admit(v4).unwrap();
        assert_eq!(
            a.host_connections("::ffff:10.9.9.9".parse().unwrap()),
            1,
            "IPv4-mapped"
        );
    }
}
