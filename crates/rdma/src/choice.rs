//! Choosing a provider: `auto`, `soft` or `verbs`, as the server's
//! configuration and the clients' `--provider` say.

use crate::{Config, Context, DeviceInfo, Error, Provider};

/// Which RDMA provider to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProviderChoice {
    /// The first usable provider, in [`crate::providers()`] order.
    #[default]
    Auto,
    /// The user-space iWARP provider over TCP (runs anywhere).
    Soft,
    /// libibverbs: RDMA NICs, rxe, siw.
    Verbs,
}

impl ProviderChoice {
    /// Every choice, in the order help texts list them.
    pub const ALL: [ProviderChoice; 3] = [
        ProviderChoice::Auto,
        ProviderChoice::Soft,
        ProviderChoice::Verbs,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderChoice::Auto => "auto",
            ProviderChoice::Soft => "soft",
            ProviderChoice::Verbs => "verbs",
        }
    }
}

impl std::fmt::Display for ProviderChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ProviderChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ProviderChoice::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| format!("unknown provider `{s}` (expected auto, soft or verbs)"))
    }
}

/// Providers to try for a choice, in preference order (`auto`: soft first —
/// it runs anywhere; verbs where both hosts share a device is chosen
/// explicitly).
pub fn providers_for(choice: ProviderChoice) -> Vec<Provider> {
    let all = crate::providers();
    match choice {
        ProviderChoice::Auto => all,
        ProviderChoice::Soft => all.into_iter().filter(|p| p.name() == "soft").collect(),
        ProviderChoice::Verbs => all.into_iter().filter(|p| p.name() == "verbs").collect(),
    }
}

/// Open `device` (None = the first usable one) of the first provider that
/// works.
pub fn open_context(
    choice: ProviderChoice,
    device: Option<&str>,
    cfg: &Config,
) -> Result<Context, Error> {
    let mut last = None;
    for p in providers_for(choice) {
        match p.open(device, cfg) {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::debug!(provider = p.name(), error = %e, "provider not usable");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| {
        Error::ProviderUnavailable(format!(
            "no RDMA provider for choice {:?} in this build",
            choice.as_str()
        ))
    }))
}

/// The devices a choice may use, in preference order, with their provider:
/// `verbs` — the named device or every verbs device; `soft` — the soft
/// provider's device; `auto` — every verbs device (hardware first), then
/// the soft provider. Unusable devices are listed too (`usable` says why);
/// callers skip them.
pub fn devices_for(choice: ProviderChoice, device: Option<&str>) -> Vec<(Provider, DeviceInfo)> {
    let mut all = crate::providers();
    // Hardware first: verbs before soft, whatever the build's order.
    all.sort_by_key(|p| p.name() == "soft");
    let mut out = Vec::new();
    for p in all {
        let wanted = match choice {
            ProviderChoice::Auto => true,
            ProviderChoice::Soft => p.name() == "soft",
            ProviderChoice::Verbs => p.name() == "verbs",
        };
        if !wanted {
            continue;
        }
        for d in p.devices() {
            if device.is_none_or(|n| n == d.name)
                || (device.is_some() && p.name() == "soft" && choice == ProviderChoice::Auto)
            {
                out.push((p.clone(), d));
            }
        }
    }
    out
}

/// The local source address the kernel would use to reach `dst` (a UDP
/// socket's connect sends nothing; it only picks the route).
pub fn source_ip(dst: std::net::IpAddr) -> Option<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
    let any = match dst {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let s = UdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    s.connect(SocketAddr::new(dst, 9)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// The usable device of `provider` that owns the address `ip` (the device
/// a listener on `ip` must use, or the one a connection whose route leaves
/// from `ip` goes out of).
pub fn device_owning(provider: &Provider, ip: std::net::IpAddr) -> Option<String> {
    provider
        .devices()
        .into_iter()
        .find(|d| d.usable.is_ok() && d.addresses.contains(&ip))
        .map(|d| d.name)
}
