//! Device discovery: ibverbs device list, capabilities, port state, and the
//! IP addresses of the network devices behind an RDMA device (sysfs +
//! getifaddrs).

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ptr;

use super::ffi::*;
use crate::verbs::*;

/// Limits of a device that the context needs besides `DeviceCaps`.
pub(super) struct DevLimits {
    pub max_ird: u8,
    pub max_ord: u8,
}

/// Every ibverbs device, described through a short-lived context of its own.
pub(super) fn list_devices(lib: &'static Lib) -> Vec<DeviceInfo> {
    let mut n = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a
    // NULL-terminated array (freed below) or NULL with errno set.
    let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return vec![DeviceInfo {
            provider: "verbs",
            name: "(none)".into(),
            transport: Transport::Other,
            addresses: Vec::new(),
            usable: Err(format!("ibv_get_device_list: {e}")),
            caps: None,
        }];
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the list; each is a live ibv_device.
        let dev = unsafe { *list.add(i) };
        // SAFETY: dev is live until ibv_free_device_list.
        let ctx = unsafe { (lib.ibv_open_device)(dev) };
        if ctx.is_null() {
            let e = std::io::Error::last_os_error();
            // SAFETY: dev is live; name/node_type are plain fields.
            let (name, transport) = unsafe {
                (
                    cstr_array(&(*dev).name),
                    transport_of((*dev).transport_type, IBV_LINK_LAYER_UNSPECIFIED),
                )
            };
            out.push(DeviceInfo {
                provider: "verbs",
                addresses: addresses(&name, transport),
                name,
                transport,
                usable: Err(format!("ibv_open_device: {e}")),
                caps: None,
            });
            continue;
        }
        // SAFETY: ctx is the live context just opened for dev.
        let (info, _) = unsafe { describe(lib, ctx, dev) };
        out.push(info);
        // SAFETY: closes the context opened above, which nothing else uses.
        unsafe { (lib.ibv_close_device)(ctx) };
    }
    // SAFETY: frees the list from ibv_get_device_list once; the devices are
    // not used afterwards.
    unsafe { (lib.ibv_free_device_list)(list) };
    out
}

fn transport_of(transport_type: i32, link_layer: u8) -> Transport {
    match (transport_type, link_layer) {
        (IBV_TRANSPORT_IWARP, _) => Transport::Iwarp,
        (IBV_TRANSPORT_IB, IBV_LINK_LAYER_ETHERNET) => Transport::Roce,
        (IBV_TRANSPORT_IB, _) => Transport::Infiniband,
        _ => Transport::Other,
    }
}

fn port_state_name(s: u32) -> &'static str {
    match s {
        0 => "NOP",
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "unknown",
    }
}

/// Describe a device through an open context.
///
/// # Safety
/// `ctx` must be a live context of the live device `dev`.
pub(super) unsafe fn describe(
    lib: &'static Lib,
    ctx: *mut ibv_context,
    dev: *mut ibv_device,
) -> (DeviceInfo, DevLimits) {
    let name = cstr_array(&(*dev).name);
    let transport_type = (*dev).transport_type;
    let mut attr: ibv_device_attr = std::mem::zeroed();
    let qd = (lib.ibv_query_device)(ctx, &mut attr);
    let mut port: ibv_port_attr = std::mem::zeroed();
    let qp = (lib.ibv_query_port)(ctx, 1, &mut port);
    let transport = transport_of(
        transport_type,
        if qp == 0 {
            port.link_layer
        } else {
            IBV_LINK_LAYER_UNSPECIFIED
        },
    );
    let mut limits = DevLimits {
        max_ird: 0,
        max_ord: 0,
    };
    let caps = if qd == 0 {
        let flags = attr.device_cap_flags;
        let rxe = is_rxe(&name, transport);
        // rxe (Linux 6.1) binds type-2 windows but checks remote accesses
        // against the underlying region's range, not the window's: such a
        // window does not confine the peer, so rxe gets the fallback unless
        // LWIO_IBV_NATIVE_MW=1 forces native windows (for testing).
        let force_native = std::env::var_os("LWIO_IBV_NATIVE_MW").is_some_and(|v| v == "1");
        let native = flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2B | IBV_DEVICE_MEM_WINDOW_TYPE_2A) != 0
            && attr.max_mw > 0
            && (!rxe || force_native);
        limits.max_ird = attr.max_qp_rd_atom.clamp(0, 255) as u8;
        limits.max_ord = attr.max_qp_init_rd_atom.clamp(0, 255) as u8;
        Some(DeviceCaps {
            max_mr_size: attr.max_mr_size,
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_sge: attr.max_sge.max(0) as u32,
            // Not reported by ibv_query_device; every device lwio targets
            // (rxe: 256, siw: 192, mlx5, irdma…) supports at least 64.
            max_inline_data: 64,
            max_ird: limits.max_ird as u32,
            max_ord: limits.max_ord as u32,
            max_msg_size: if qp == 0 && port.max_msg_sz > 0 {
                port.max_msg_sz as u64
            } else {
                1 << 31
            },
            mw_kind: if native {
                MwKind::Native
            } else {
                MwKind::PerRequestRegistration
            },
            one_shot_mw: false,
            write_with_imm: transport != Transport::Iwarp,
            // rxe cannot remotely invalidate user-registered regions, which
            // is what fallback window keys are.
            send_with_invalidate: transport == Transport::Iwarp
                || (flags & IBV_DEVICE_MEM_MGT_EXTENSIONS != 0 && (native || !rxe)),
            max_srq_wr: if attr.max_srq > 0 {
                attr.max_srq_wr.max(0) as u32
            } else {
                0
            },
            max_srq_sge: if attr.max_srq > 0 {
                attr.max_srq_sge.max(0) as u32
            } else {
                0
            },
        })
    } else {
        None
    };
    let usable = if qd != 0 {
        Err(format!("ibv_query_device failed ({qd})"))
    } else if qp != 0 {
        Err(format!("ibv_query_port(1) failed ({qp})"))
    } else if port.state != IBV_PORT_ACTIVE {
        Err(format!("port 1 is {}", port_state_name(port.state)))
    } else {
        Ok(())
    };
    (
        DeviceInfo {
            provider: "verbs",
            addresses: addresses(&name, transport),
            name,
            transport,
            usable,
            caps,
        },
        limits,
    )
}

/// Soft-RoCE: only rxe has the `parent` attribute (its netdev) in sysfs.
pub(super) fn is_rxe(name: &str, transport: Transport) -> bool {
    transport == Transport::Roce
        && std::path::Path::new(&format!("/sys/class/infiniband/{name}/parent")).exists()
}

/// soft-iWARP: siw sets node_desc to "Software iWARP stack".
pub(super) fn is_siw(name: &str, transport: Transport) -> bool {
    transport == Transport::Iwarp
        && std::fs::read_to_string(format!("/sys/class/infiniband/{name}/node_desc"))
            .is_ok_and(|d| d.starts_with("Software iWARP stack"))
}

/// The netdevs behind an RDMA device: RoCE GID attributes, else (iWARP) the
/// netdev whose MAC address is the device's GID 0.
fn netdevs(dev: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let base = format!("/sys/class/infiniband/{dev}/ports/1");
    if let Ok(rd) = std::fs::read_dir(format!("{base}/gid_attrs/ndevs")) {
        for e in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(e.path()) {
                let s = s.trim();
                if !s.is_empty() {
                    out.insert(s.to_string());
                }
            }
        }
    }
    if out.is_empty() {
        if let Ok(gid) = std::fs::read_to_string(format!("{base}/gids/0")) {
            let hex: String = gid.trim().chars().filter(|c| *c != ':').collect();
            if hex.len() >= 12 {
                let mac: Vec<String> = (0..6).map(|i| hex[2 * i..2 * i + 2].to_string()).collect();
                let mac = mac.join(":").to_ascii_lowercase();
                if mac != "00:00:00:00:00:00" {
                    if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
                        for e in rd.flatten() {
                            if let Ok(a) = std::fs::read_to_string(e.path().join("address")) {
                                if a.trim().eq_ignore_ascii_case(&mac) {
                                    out.insert(e.file_name().to_string_lossy().into_owned());
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// IP addresses (link-local IPv6 excluded) of the netdevs behind `dev`.
pub(super) fn addresses(dev: &str, _transport: Transport) -> Vec<IpAddr> {
    let nd = netdevs(dev);
    if nd.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free with freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return out;
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: p walks the list returned by getifaddrs, valid until
        // freeifaddrs; ifa_name is a NUL-terminated string and ifa_addr is
        // NULL or a sockaddr of the family it announces.
        unsafe {
            let a = &*p;
            p = a.ifa_next;
            if a.ifa_addr.is_null() {
                continue;
            }
            let name = CStr::from_ptr(a.ifa_name).to_string_lossy();
            if !nd.contains(name.as_ref()) {
                continue;
            }
            match (*a.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sin = &*(a.ifa_addr as *const libc::sockaddr_in);
                    out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))));
                }
                libc::AF_INET6 => {
                    let sin6 = &*(a.ifa_addr as *const libc::sockaddr_in6);
                    let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                    if ip.segments()[0] & 0xffc0 != 0xfe80 {
                        out.push(IpAddr::V6(ip));
                    }
                }
                _ => {}
            }
        }
    }
    // SAFETY: frees the list once; no pointer into it is kept.
    unsafe { libc::freeifaddrs(ifa) };
    out
}
