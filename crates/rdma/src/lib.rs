//! lwio's RDMA layer: one verbs API ([`verbs`]) and its providers.
//!
//! * `soft` — the IETF iWARP stack (MPA/DDP/RDMAP) in user space over TCP;
//!   runs anywhere and speaks to Linux siw and iWARP NICs.
//! * `ibv` — libibverbs/librdmacm, loaded at run time, for RDMA NICs and the
//!   kernel's rxe and siw.
//!
//! [`providers`] lists the providers compiled in; a provider that cannot be
//! used on this host is still listed, with the reason, by `devices()`.

pub mod choice;
/// The verbs conformance suite (`lwio-conformance`, the `conformance`
/// feature, on by default; off in lwio-client's and lwio-server's trees).
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod ibv;
/// Micro-benchmarks (`lwio rdma-bench`, the `perf` feature, on by
/// default; off in lwio-client's and lwio-server's trees).
#[cfg(feature = "perf")]
pub mod perf;
pub mod soft;
pub mod verbs;

pub use choice::{
    device_owning, devices_for, open_context, providers_for, source_ip, ProviderChoice,
};
pub use verbs::*;

/// Every provider compiled into this build, in preference order for `auto`.
#[allow(clippy::vec_init_then_push)]
pub fn providers() -> Vec<Provider> {
    #[allow(unused_mut)]
    let mut v: Vec<Provider> = Vec::new();
    // provider registrations (one line per provider module):
    v.push(soft::provider());
    v.push(ibv::provider());
    v
}

/// A provider by name (`soft`, `verbs`).
pub fn provider(name: &str) -> Result<Provider> {
    providers()
        .into_iter()
        .find(|p| p.name() == name)
        .ok_or_else(|| {
            Error::ProviderUnavailable(format!("no provider named {name:?} in this build"))
        })
}
