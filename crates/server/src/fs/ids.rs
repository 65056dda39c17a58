//! Acting as the caller: an export's identity policy (docs/mount.md,
//! "Identities") and the per-thread file-system credentials a request of an
//! `identity = "client"` export runs under.
//!
//! The server never changes its process-wide ids. For the duration of one
//! file-system call, the thread that makes it takes the caller's
//! file-system uid and gid (`setfsuid(2)`, `setfsgid(2)`), supplementary
//! groups (the raw `setgroups` system call, which is per thread in the
//! kernel; glibc's wrapper would change every thread of the process) and a
//! umask of 0 (the client applied the caller's umask already), then puts
//! its own back. The kernel then does every check itself, exactly as for a
//! local process of that user: mode bits, the sticky bit, setgid
//! directories, chown and chmod rules, the owner of what is created.
//!
//! A file-system uid other than 0 also drops the file-system capabilities
//! (`CAP_DAC_OVERRIDE`, `CAP_CHOWN`, `CAP_FOWNER`, …) from the thread's
//! effective set, and taking uid 0 back restores them (capabilities(7),
//! "Effect of user ID changes on capabilities"). So a squashed root is an
//! ordinary user, and `no_root_squash` is root.
//!
//! The chosen mechanism, against "check the permissions ourselves, then
//! `fchownat`": the kernel's rules are many (ACLs, the sticky bit, setgid
//! inheritance, `S_ISGID` clearing on chmod by a non-member, `utimensat`'s
//! owner rules) and differ by file system; re-implementing them would be a
//! second, weaker copy, and a create followed by a chown leaves a window in
//! which the file has the wrong owner. Measured cost: bench/RESULTS.md.

use std::cell::Cell;

use lwio_side::error::{Error, ErrorCode, Result};
pub use lwio_side::types::Creds;

/// What an export does with the ids a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdentityMode {
    /// Every call as the server's own uid and gid (the default).
    #[default]
    Server,
    /// Every call as the caller, under the squash rules.
    Client,
}

/// An export's identity policy: `identity`, and the keys of exports(5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub mode: IdentityMode,
    /// uid 0 acts as `anon_uid` (and gid 0 as `anon_gid`). Default true.
    pub root_squash: bool,
    /// Every caller acts as `anon_uid`/`anon_gid`. Default false.
    pub all_squash: bool,
    pub anon_uid: u32,
    pub anon_gid: u32,
    /// Logins whose asserted ids are believed: user names, `"*"` (any
    /// authenticated login, the shared token's included). Others act as
    /// their user's configured `uid`/`gid`, or are refused.
    pub trust_client_ids: Vec<String>,
}

/// nobody/nogroup: exports(5)'s default `anonuid`/`anongid`.
pub const NOBODY: u32 = 65534;

impl Default for Identity {
    fn default() -> Identity {
        Identity {
            mode: IdentityMode::Server,
            root_squash: true,
            all_squash: false,
            anon_uid: NOBODY,
            anon_gid: NOBODY,
            trust_client_ids: Vec::new(),
        }
    }
}

/// Who the caller is to an export's policy.
pub struct Caller<'a> {
    /// The login's name for `trust_client_ids` (`None`: anonymous).
    pub login: Option<&'a str>,
    /// Whether the login is a configured user (matched by name) or the
    /// shared token (matched only by `"*"`).
    pub is_user: bool,
    /// The ids the request carries, if any.
    pub asserted: Option<&'a Creds>,
    /// The login's configured `uid`/`gid` (`[users.NAME]`), if any.
    pub configured: Option<(u32, u32)>,
}

impl Identity {
    fn anon(&self) -> Creds {
        Creds {
            uid: self.anon_uid,
            gid: self.anon_gid,
            groups: Vec::new(),
        }
    }

    fn trusts(&self, c: &Caller<'_>) -> bool {
        let Some(login) = c.login else { return false };
        self.trust_client_ids
            .iter()
            .any(|t| t == "*" || (c.is_user && t == login))
    }

    /// The ids a call of `caller` runs as: `None` for `identity =
    /// "server"` (the server's own), else the caller's after squashing.
    /// An untrusted login with no configured ids is refused.
    pub fn resolve(&self, export: &str, c: &Caller<'_>) -> Result<Option<Creds>> {
        if self.mode == IdentityMode::Server {
            return Ok(None);
        }
        let ids = if self.all_squash || c.login.is_none() {
            self.anon()
        } else if let (true, Some(a)) = (self.trusts(c), c.asserted) {
            a.clone()
        } else if let Some((uid, gid)) = c.configured {
            Creds {
                uid,
                gid,
                groups: Vec::new(),
            }
        } else if self.trusts(c) {
            // A trusted login that asserts nothing (a program that is not
            // a mount): NFS's AUTH_NONE, the anonymous ids.
            self.anon()
        } else {
            return Err(Error::new(
                ErrorCode::PermissionDenied,
                format!(
                    "export {export} acts as the caller's identity: login {} is not in its trust_client_ids and has no uid configured",
                    c.login.unwrap_or("anonymous")
                ),
            ));
        };
        Ok(Some(self.squash(ids)))
    }

    fn squash(&self, mut c: Creds) -> Creds {
        if self.all_squash {
            return self.anon();
        }
        if self.root_squash {
            if c.uid == 0 {
                c.uid = self.anon_uid;
            }
            if c.gid == 0 {
                c.gid = self.anon_gid;
            }
            for g in &mut c.groups {
                if *g == 0 {
                    *g = self.anon_gid;
                }
            }
        }
        c
    }
}

/// `identity = "server"`: the server's user owns everything. What a
/// client asks is bounded so that it cannot make more of that than a file
/// of the server's user (docs/security.md, "Identities"):
/// set-user-id and set-group-id bits are cleared from the modes it gives
/// (a client of a root server would otherwise leave setuid-root programs
/// on it), and a chown may name only the server's uid and its groups, as
/// a non-root owner's chown may (else `NotPermitted`, EPERM).
pub fn server_bounds(set: &mut lwio_side::types::SetAttr, what: &str) -> Result<()> {
    if let Some(m) = &mut set.mode {
        *m = strip_setid(*m);
    }
    // SAFETY: geteuid/getegid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if set.uid.is_some_and(|u| u != uid) {
        return Err(Error::new(
            ErrorCode::NotPermitted,
            format!("{what}: this export's files all belong to the server's user (identity = \"server\"): chown to uid {} refused", set.uid.unwrap_or_default()),
        ));
    }
    if let Some(g) = set.gid {
        if g != gid && !getgroups()?.contains(&g) {
            return Err(Error::new(
                ErrorCode::NotPermitted,
                format!("{what}: chown to gid {g}, not a group of the server's user (identity = \"server\")"),
            ));
        }
    }
    Ok(())
}

/// `mode` without S_ISUID and S_ISGID (see [`server_bounds`]).
pub fn strip_setid(mode: u32) -> u32 {
    mode & !(libc::S_ISUID | libc::S_ISGID)
}

/// Whether this process may act as other users (`identity = "client"`):
/// it holds `CAP_SETUID` and `CAP_SETGID` (as root does), probed by taking
/// another file-system uid and giving it back.
pub fn can_switch() -> bool {
    let probe = Creds {
        uid: NOBODY,
        gid: NOBODY,
        groups: Vec::new(),
    };
    Switch::to(&probe).is_ok()
}

/// Run `f` as `ids` (`None`: as the server). The thread's own ids are back
/// when this returns, whatever `f` did (a panic included).
pub fn as_caller<T>(ids: Option<&Creds>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(ids) = ids else { return f() };
    let _back = Switch::to(ids)?;
    f()
}

thread_local! {
    /// The thread has its own umask, cwd and root (`unshare(CLONE_FS)`),
    /// so a umask of 0 for one call does not reach the other threads.
    static OWN_FS: Cell<bool> = const { Cell::new(false) };
}

/// The thread's own file-system credentials while a call runs as another
/// user; Drop puts them back.
struct Switch {
    uid: u32,
    gid: u32,
    groups: Vec<libc::gid_t>,
    umask: libc::mode_t,
}

fn setfsuid(uid: u32) -> u32 {
    // SAFETY: setfsuid takes an integer and changes only this thread's
    // credentials; it returns the previous file-system uid and cannot fail
    // in a way that touches memory.
    unsafe { libc::syscall(libc::SYS_setfsuid, uid as libc::c_long) as u32 }
}

fn setfsgid(gid: u32) -> u32 {
    // SAFETY: as setfsuid: an integer in, the previous fsgid out.
    unsafe { libc::syscall(libc::SYS_setfsgid, gid as libc::c_long) as u32 }
}

fn getgroups() -> Result<Vec<libc::gid_t>> {
    // SAFETY: size 0 asks for the count only and writes nothing.
    let n = unsafe { libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<libc::gid_t>()) };
    if n < 0 {
        return Err(Error::from_io(
            &std::io::Error::last_os_error(),
            "getgroups",
        ));
    }
    let mut v = vec![0 as libc::gid_t; n as usize];
    // SAFETY: the kernel writes at most `v.len()` gids into `v`, which is
    // that long and ours alone.
    let m = unsafe { libc::syscall(libc::SYS_getgroups, v.len() as libc::c_long, v.as_mut_ptr()) };
    if m < 0 {
        return Err(Error::from_io(
            &std::io::Error::last_os_error(),
            "getgroups",
        ));
    }
    v.truncate(m as usize);
    Ok(v)
}

/// The raw system call: per thread, unlike glibc's `setgroups(3)`, which
/// changes every thread of the process.
fn setgroups(g: &[libc::gid_t]) -> std::io::Result<()> {
    // SAFETY: the kernel reads `g.len()` gids from `g`, which lives for the
    // call; it writes nothing.
    let r = unsafe { libc::syscall(libc::SYS_setgroups, g.len() as libc::c_long, g.as_ptr()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn umask(m: libc::mode_t) -> libc::mode_t {
    // SAFETY: umask takes a mode and returns the previous one; after
    // `unshare(CLONE_FS)` it is this thread's alone.
    unsafe { libc::umask(m) }
}

fn refused(what: &str) -> Error {
    Error::new(
        ErrorCode::PermissionDenied,
        format!("the server cannot act as the caller ({what}): it needs CAP_SETUID and CAP_SETGID (run it as root, or set identity = \"server\")"),
    )
}

impl Switch {
    fn to(ids: &Creds) -> Result<Switch> {
        if !OWN_FS.get() {
            // SAFETY: unshare with CLONE_FS only gives this thread its own
            // copy of the umask, cwd and root; it is allowed in a
            // multithreaded process and touches no memory of ours.
            if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
                return Err(Error::from_io(
                    &std::io::Error::last_os_error(),
                    "unshare(CLONE_FS)",
                ));
            }
            OWN_FS.set(true);
        }
        let groups = getgroups()?;
        let back = Switch {
            uid: setfsuid(u32::MAX),
            gid: setfsgid(u32::MAX),
            groups,
            umask: umask(0),
        };
        let g: Vec<libc::gid_t> = ids.groups.clone();
        if setgroups(&g).is_err() {
            // Nothing changed yet but the umask; dropping `back` restores it.
            return Err(refused("setgroups"));
        }
        setfsgid(ids.gid);
        if setfsgid(u32::MAX) != ids.gid {
            return Err(refused("setfsgid"));
        }
        setfsuid(ids.uid);
        if setfsuid(u32::MAX) != ids.uid {
            return Err(refused("setfsuid"));
        }
        Ok(back)
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        // The uid first: uid 0 gives back the capabilities that restoring
        // the gid and the groups need.
        setfsuid(self.uid);
        setfsgid(self.gid);
        let _ = setgroups(&self.groups);
        umask(self.umask);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(mode: IdentityMode) -> Identity {
        Identity {
            mode,
            trust_client_ids: vec!["alice".into()],
            ..Identity::default()
        }
    }

    fn caller<'a>(login: Option<&'a str>, asserted: Option<&'a Creds>) -> Caller<'a> {
        Caller {
            login,
            is_user: true,
            asserted,
            configured: None,
        }
    }

    #[test]
    fn squash_and_trust() {
        let root = Creds {
            uid: 0,
            gid: 0,
            groups: vec![0, 5],
        };
        let bob = Creds {
            uid: 1001,
            gid: 1001,
            groups: vec![27],
        };
        let s = policy(IdentityMode::Server);
        assert_eq!(
            s.resolve("e", &caller(Some("alice"), Some(&root))).unwrap(),
            None
        );
        let c = policy(IdentityMode::Client);
        // Trusted: the asserted ids, root squashed.
        assert_eq!(
            c.resolve("e", &caller(Some("alice"), Some(&root))).unwrap(),
            Some(Creds {
                uid: NOBODY,
                gid: NOBODY,
                groups: vec![NOBODY, 5]
            })
        );
        assert_eq!(
            c.resolve("e", &caller(Some("alice"), Some(&bob))).unwrap(),
            Some(bob.clone())
        );
        // no_root_squash: root stays root.
        let nrs = Identity {
            root_squash: false,
            ..policy(IdentityMode::Client)
        };
        assert_eq!(
            nrs.resolve("e", &caller(Some("alice"), Some(&root)))
                .unwrap(),
            Some(root.clone())
        );
        // Untrusted: refused, or its configured ids whatever it asserts.
        let e = c
            .resolve("e", &caller(Some("mallory"), Some(&root)))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::PermissionDenied);
        assert!(e.message.contains("trust_client_ids"), "{e}");
        let mut m = caller(Some("mallory"), Some(&root));
        m.configured = Some((2000, 2000));
        assert_eq!(
            c.resolve("e", &m).unwrap(),
            Some(Creds {
                uid: 2000,
                gid: 2000,
                groups: vec![]
            })
        );
        // The shared token is trusted only through "*".
        let mut t = caller(Some("alice"), Some(&bob));
        t.is_user = false;
        assert!(c.resolve("e", &t).is_err());
        let star = Identity {
            trust_client_ids: vec!["*".into()],
            ..policy(IdentityMode::Client)
        };
        assert_eq!(star.resolve("e", &t).unwrap(), Some(bob.clone()));
        // Anonymous, and all_squash: the anonymous ids.
        let anon = Some(Creds {
            uid: NOBODY,
            gid: NOBODY,
            groups: vec![],
        });
        assert_eq!(star.resolve("e", &caller(None, Some(&bob))).unwrap(), anon);
        let all = Identity {
            all_squash: true,
            ..star.clone()
        };
        assert_eq!(
            all.resolve("e", &caller(Some("alice"), Some(&bob)))
                .unwrap(),
            anon
        );
        // Trusted with nothing asserted: anonymous too.
        assert_eq!(
            star.resolve("e", &caller(Some("alice"), None)).unwrap(),
            anon
        );
    }

    #[test]
    fn a_call_runs_as_the_caller_and_the_thread_gets_its_ids_back() {
        if !can_switch() {
            crate::io_phase::testkit::skip("needs root (CAP_SETUID) to switch ids");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let ids = Creds {
            uid: 4242,
            gid: 4343,
            groups: vec![4444],
        };
        let before = (setfsuid(u32::MAX), setfsgid(u32::MAX), getgroups().unwrap());
        // The directory is root's 0755: the caller may not create in it.
        let e = as_caller(Some(&ids), || {
            std::fs::File::create(&p).map_err(|e| Error::from_io(&e, "create"))
        })
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::PermissionDenied, "{e}");
        assert!(!p.exists());
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        as_caller(Some(&ids), || {
            std::fs::File::create(&p).map_err(|e| Error::from_io(&e, "create"))
        })
        .unwrap();
        let md = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&p).unwrap());
        assert_eq!(md, 4242);
        let gid = std::os::unix::fs::MetadataExt::gid(&std::fs::metadata(&p).unwrap());
        assert_eq!(gid, 4343);
        // Created with the caller's mode as given: umask 0 for the call.
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&p).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o666);
        let after = (setfsuid(u32::MAX), setfsgid(u32::MAX), getgroups().unwrap());
        assert_eq!(before, after);
        // And a panic inside gives them back too.
        let r = std::panic::catch_unwind(|| {
            let _ = as_caller(Some(&ids), || -> Result<()> { panic!("inside") });
        });
        assert!(r.is_err());
        assert_eq!(
            (setfsuid(u32::MAX), setfsgid(u32::MAX), getgroups().unwrap()),
            before
        );
    }
}
