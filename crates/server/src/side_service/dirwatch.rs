//! Lease breaks for changes made on the server's own file system
//! (docs/leases.md, "Changes made on the server"): a program on the
//! server, or NFS or SMB exporting the same directory, changes a leased
//! directory without lwio knowing. The server marks every leased
//! directory with fanotify and breaks its leases on any event there that
//! another process caused; events of its own process (every lwio change,
//! which `Leases::break_for` already handled) are skipped by the pid that
//! fanotify reports.
//!
//! fanotify (not inotify) because it tells who made the change: inotify
//! would report lwio's own creates and writes too, and each would break
//! the lease of the client that made it. It needs `CAP_SYS_ADMIN` and
//! Linux 5.9 (`FAN_REPORT_DFID_NAME`); without them the server logs once
//! that such changes show within `lease_timeout`, as before.
//!
//! Bounded: at most `max_leases` directories are marked; past that every
//! mark is dropped and every lease broken (holders lease again as they
//! list), as after a queue overflow.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use tracing::{debug, info, warn};

use super::leases::{DirKey, Leases};
use crate::fs::fdcache::Handle;

/// What is reported of a directory: its file handle's type and bytes.
type HandleKey = (i32, Vec<u8>);

/// The events that change what a lease caches: names, attributes and
/// sizes in the directory, and the directory itself going away.
const MASK: u64 = libc::FAN_CREATE
    | libc::FAN_DELETE
    | libc::FAN_MOVED_FROM
    | libc::FAN_MOVED_TO
    | libc::FAN_ATTRIB
    | libc::FAN_MODIFY
    | libc::FAN_CLOSE_WRITE
    | libc::FAN_DELETE_SELF
    | libc::FAN_MOVE_SELF
    | libc::FAN_ONDIR
    | libc::FAN_EVENT_ON_CHILD;

#[derive(Default)]
struct Marks {
    by_handle: HashMap<HandleKey, DirKey>,
}

/// The fanotify group of the server and the directories it marks.
pub struct DirWatch {
    fd: OwnedFd,
    marks: Mutex<Marks>,
    max: usize,
}

impl std::fmt::Debug for DirWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatch").finish_non_exhaustive()
    }
}

impl DirWatch {
    /// A fanotify group, and a thread that breaks `leases` on the events
    /// of other processes; `None` (logged) where fanotify is not allowed.
    pub fn start(leases: Arc<Leases>, max: usize) -> Option<Arc<DirWatch>> {
        // SAFETY: fanotify_init takes flags and returns a new descriptor
        // (or -1); no memory is passed.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC | libc::FAN_REPORT_DFID_NAME,
                (libc::O_RDONLY | libc::O_CLOEXEC) as libc::c_uint,
            )
        };
        if fd < 0 {
            info!(
                error = %std::io::Error::last_os_error(),
                "no fanotify (it needs CAP_SYS_ADMIN and Linux 5.9): a change made on the server's own file system shows on leased mounts within lease_timeout"
            );
            return None;
        }
        // SAFETY: `fd` was just returned by fanotify_init and is ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let w = Arc::new(DirWatch {
            fd,
            marks: Mutex::new(Marks::default()),
            max,
        });
        let r = w.clone();
        std::thread::Builder::new()
            .name("lwio-dirwatch".into())
            .spawn(move || r.run(&leases))
            .ok()?;
        Some(w)
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Mark `dir` (the directory of lease `key`, opened for reading)
    /// before its lease is granted, so that nothing done after the grant
    /// is missed.
    pub fn watch(&self, dir: BorrowedFd<'_>, key: &DirKey, leases: &Leases) {
        let h = match Handle::of_fd(dir.as_raw_fd()) {
            Ok(h) => h,
            Err(e) => {
                debug!(export = %key.0, dir = %key.1, errno = e, "no file handle: not watched");
                return;
            }
        };
        let (kind, bytes) = h.parts();
        let hk = (kind, bytes.to_vec());
        let mut m = self.marks();
        if m.by_handle.contains_key(&hk) {
            return;
        }
        if m.by_handle.len() >= self.max {
            // Bounded: start over (every holder leases again as it lists).
            self.flush(&mut m);
            drop(m);
            let n = leases.break_all_external();
            warn!(
                marks = self.max,
                leases = n,
                "watched-directory limit reached: every lease broken"
            );
            m = self.marks();
        }
        // SAFETY: a valid descriptor of ours and a null path: the kernel
        // marks the inode of `dir`; no memory of ours is written.
        let r = unsafe {
            libc::fanotify_mark(
                self.fd.as_raw_fd(),
                libc::FAN_MARK_ADD,
                MASK,
                dir.as_raw_fd(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            debug!(export = %key.0, dir = %key.1, error = %std::io::Error::last_os_error(), "fanotify_mark");
            return;
        }
        m.by_handle.insert(hk, key.clone());
    }

    fn flush(&self, m: &mut Marks) {
        // SAFETY: FAN_MARK_FLUSH takes no path or descriptor but our group.
        unsafe {
            libc::fanotify_mark(
                self.fd.as_raw_fd(),
                libc::FAN_MARK_FLUSH,
                0,
                libc::AT_FDCWD,
                std::ptr::null(),
            );
        }
        m.by_handle.clear();
    }

    fn run(&self, leases: &Leases) {
        let me = std::process::id() as i32;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // SAFETY: the kernel writes at most `buf.len()` bytes into
            // `buf`, which is ours and that long.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                warn!(error = %e, "fanotify read failed; local changes no longer break leases");
                return;
            }
            for ev in events(&buf[..n as usize]) {
                if ev.mask & libc::FAN_Q_OVERFLOW != 0 {
                    let n = leases.break_all_external();
                    warn!(leases = n, "fanotify queue overflow: every lease broken");
                    continue;
                }
                if ev.pid == me {
                    continue;
                }
                let key = self.marks().by_handle.get(&ev.dir).cloned();
                if let Some(key) = key {
                    let n = leases.break_external(&key);
                    if n > 0 {
                        debug!(export = %key.0, dir = %key.1, pid = ev.pid, mask = ev.mask, leases = n, "changed on the server: leases broken");
                    }
                }
            }
        }
    }
}

/// One event: who, what, and the directory it happened in.
#[derive(Debug, PartialEq, Eq)]
struct Event {
    mask: u64,
    pid: i32,
    /// The directory's file handle (the parent of the entry for events on
    /// an entry, the directory itself for its own).
    dir: HandleKey,
}

/// The events of one read(2) of a `FAN_REPORT_DFID_NAME` group, parsed
/// from the bytes (fanotify(7)): `fanotify_event_metadata` (24 bytes:
/// event_len u32, vers u8, reserved u8, metadata_len u16, mask u64, fd
/// i32, pid i32), then info records (`fanotify_event_info_header`: type
/// u8, pad u8, len u16; a FID record adds fsid 8 bytes, handle_bytes u32,
/// handle_type i32, the handle, and for DFID_NAME the name). Malformed
/// input ends the parse; it never panics.
fn events(mut b: &[u8]) -> Vec<Event> {
    let mut out = Vec::new();
    let u16_at = |s: &[u8], o: usize| s.get(o..o + 2).map(|x| u16::from_ne_bytes([x[0], x[1]]));
    let u32_at = |s: &[u8], o: usize| {
        s.get(o..o + 4)
            .map(|x| u32::from_ne_bytes([x[0], x[1], x[2], x[3]]))
    };
    while b.len() >= 24 {
        let Some(len) = u32_at(b, 0).map(|l| l as usize) else {
            break;
        };
        let Some(meta) = u16_at(b, 6).map(usize::from) else {
            break;
        };
        if len < 24 || len > b.len() || meta < 24 || meta > len {
            break;
        }
        let ev = &b[..len];
        let mask = u64::from_ne_bytes(ev[8..16].try_into().unwrap_or_default());
        let pid = i32::from_ne_bytes(ev[20..24].try_into().unwrap_or_default());
        let mut info = &ev[meta..];
        let mut dir = None;
        while info.len() >= 4 {
            let ty = info[0];
            let Some(ilen) = u16_at(info, 2).map(usize::from) else {
                break;
            };
            if ilen < 4 || ilen > info.len() {
                break;
            }
            let rec = &info[..ilen];
            // header 4, fsid 8, handle_bytes 4, handle_type 4, handle.
            if matches!(ty, 1..=3) && dir.is_none() {
                if let (Some(hb), Some(ht)) = (u32_at(rec, 12), u32_at(rec, 16)) {
                    if let Some(h) = rec.get(20..20 + hb as usize) {
                        dir = Some((ht as i32, h.to_vec()));
                    }
                }
            }
            info = &info[ilen..];
        }
        if let Some(dir) = dir {
            out.push(Event { mask, pid, dir });
        } else if mask & libc::FAN_Q_OVERFLOW != 0 {
            out.push(Event {
                mask,
                pid,
                dir: (0, Vec::new()),
            });
        }
        b = &b[len..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u64, pid: i32, handle: &[u8], name: &[u8]) -> Vec<u8> {
        let mut rec = vec![2u8, 0, 0, 0];
        rec.extend_from_slice(&[0; 8]);
        rec.extend_from_slice(&(handle.len() as u32).to_ne_bytes());
        rec.extend_from_slice(&1i32.to_ne_bytes());
        rec.extend_from_slice(handle);
        rec.extend_from_slice(name);
        rec.push(0);
        while rec.len() % 4 != 0 {
            rec.push(0);
        }
        let rl = rec.len() as u16;
        rec[2..4].copy_from_slice(&rl.to_ne_bytes());
        let len = (24 + rec.len()) as u32;
        let mut e = Vec::new();
        e.extend_from_slice(&len.to_ne_bytes());
        e.extend_from_slice(&[3, 0]);
        e.extend_from_slice(&24u16.to_ne_bytes());
        e.extend_from_slice(&mask.to_ne_bytes());
        e.extend_from_slice(&(-1i32).to_ne_bytes());
        e.extend_from_slice(&pid.to_ne_bytes());
        e.extend_from_slice(&rec);
        e
    }

    #[test]
    fn events_parse_and_garbage_never_panics() {
        let mut b = event(libc::FAN_CREATE, 42, &[1, 2, 3, 4, 5, 6, 7, 8], b"new");
        b.extend(event(libc::FAN_ATTRIB, 7, &[9; 12], b"x"));
        let ev = events(&b);
        assert_eq!(
            ev,
            vec![
                Event {
                    mask: libc::FAN_CREATE,
                    pid: 42,
                    dir: (1, vec![1, 2, 3, 4, 5, 6, 7, 8])
                },
                Event {
                    mask: libc::FAN_ATTRIB,
                    pid: 7,
                    dir: (1, vec![9; 12])
                }
            ]
        );
        // Every truncation and every byte changed: no panic.
        for cut in 0..b.len() {
            let _ = events(&b[..cut]);
        }
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0xff;
            let _ = events(&c);
        }
    }
}
