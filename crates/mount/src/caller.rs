//! Who a FUSE request acts for: the calling process's uid, gid and
//! supplementary groups, sent with every side-channel call the request
//! makes (docs/mount.md, "Identities"). The server acts on them only for
//! an `identity = "client"` export whose `trust_client_ids` names this
//! mount's login.
//!
//! A FUSE request is served from start to end on one thread, so the
//! callback sets the caller for its thread ([`Acting`]) and every
//! side-channel call it makes, through whatever helper, carries it.

use std::cell::RefCell;

use lwio_side::types::{Creds, MAX_GROUPS};

thread_local! {
    static CALLER: RefCell<Option<Creds>> = const { RefCell::new(None) };
}

/// The caller of the request this thread serves, if it set one.
pub(crate) fn current() -> Option<Creds> {
    CALLER.with(|c| c.borrow().clone())
}

/// While it lives, the thread's side-channel calls carry the ids of the
/// request it was made for.
pub(crate) struct Acting(());

impl Acting {
    pub(crate) fn of(req: &fuser::Request) -> Acting {
        let c = Creds {
            uid: req.uid(),
            gid: req.gid(),
            groups: groups_of(req.pid()),
        };
        CALLER.with(|s| *s.borrow_mut() = Some(c));
        Acting(())
    }
}

impl Drop for Acting {
    fn drop(&mut self) {
        CALLER.with(|s| *s.borrow_mut() = None);
    }
}

/// The supplementary groups of thread `pid` (FUSE gives the caller's
/// thread id), from the `Groups:` line of /proc/PID/status: the kernel
/// passes only the uid and gid. None (an empty list) when the process has
/// gone or is not visible here; at most [`MAX_GROUPS`].
fn groups_of(pid: u32) -> Vec<u32> {
    if pid == 0 {
        return Vec::new();
    }
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    parse_groups(&s)
}

fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_ascii_whitespace()
                .filter_map(|n| n.parse().ok())
                .take(MAX_GROUPS)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_from_proc_status() {
        let s = "Name:\tx\nUid:\t1\t1\t1\t1\nGroups:\t4 24 27 \nNgid:\t0\n";
        assert_eq!(parse_groups(s), vec![4, 24, 27]);
        assert_eq!(parse_groups("Groups:\t\n"), Vec::<u32>::new());
        assert_eq!(parse_groups("Name:\tx\n"), Vec::<u32>::new());
        let many = format!(
            "Groups:\t{}\n",
            (0..100)
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
        assert_eq!(parse_groups(&many).len(), MAX_GROUPS);
        // This process's own groups, as the kernel says.
        let own = groups_of(std::process::id());
        let mut want: Vec<u32> = {
            // SAFETY: size 0 asks for the count only and writes nothing.
            let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
            let mut v = vec![0; n as usize];
            // SAFETY: v has n entries.
            let m = unsafe { libc::getgroups(n, v.as_mut_ptr()) };
            v.truncate(m as usize);
            v
        };
        want.truncate(MAX_GROUPS);
        assert_eq!(own, want);
    }
}
