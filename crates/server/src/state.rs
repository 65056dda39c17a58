//! The lwio server process: exports, the open-file table, the I/O backend,
//! the side-channel listener, and the hook where the RDMA phase plugs in.
//!
//! ```text
//! let mut server = Server::bind(options).await?;   // opens exports, binds TCP
//! server.set_rdma_phase(Arc::new(my_rdma_listener)); // optional (RDMA phase)
//! let stop = server.shutdown_handle();            // trigger() from a signal handler
//! server.run().await?;                            // until stop.trigger()
//! ```
//!
//! The RDMA phase gets the shared [`ServerState`]: it resolves the Key of an
//! AUTH request with [`ServerState::lookup_negotiate_key`] (which yields the
//! side-channel session and its secret) and the resume key of a REGISTER with
//! [`ServerState::lookup_resume_key`]; file I/O goes through
//! [`ServerState::backend`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::config::{Config, IoConfig, Limits, ProviderChoice};
use crate::fs::backend::{open_backend, Backend};
use crate::fs::table::{Denied, OpenFile, OpenFileTable, Rights, SessionId, SrvResumeKey};
use crate::fs::{ExportSpec, Exports, ResolveMode};
use crate::side_service::access::{Acl, Principal, UserDb};
use crate::side_service::admission::Admission;
use crate::side_service::tls::ServerIdentity;
use lwio_proto::transport::Instance;
use lwio_side::auth::Token;
use lwio_side::error::{Error, ErrorCode, Result};
use lwio_side::negotiate::Guid;
use lwio_side::{host_name, SessionSecret};

/// A logged-in side-channel session, as the server knows it.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub id: SessionId,
    pub peer: SocketAddr,
    pub client_name: String,
    pub anonymous: bool,
    /// Who logged in (rights on exports follow from it).
    pub principal: Principal,
    /// Whether the side channel runs over TLS.
    pub tls: bool,
    /// Derived from the token and both nonces; keys the RDMA AUTH signature.
    pub secret: SessionSecret,
    /// The server nonce of the session's login, bound to its TLS connection
    /// (`auth::bind_nonce`): `Resume` and `WatchBreaks` proofs sent by this
    /// session name it.
    pub nonce: [u8; lwio_side::codec::NONCE_LEN],
}

/// Why a `Resume` was refused (whatever the reason: an unknown, expired or
/// foreign session, or a wrong proof).
pub const RESUME_REFUSED: &str =
    "resume refused: no lost session of yours with that id, or a wrong proof of its secret";

/// What a negotiate over the pipe left behind for the RDMA AUTH.
#[derive(Debug, Clone)]
pub struct NegotiatedClient {
    /// The server Key (GUID) returned in the negotiate response.
    pub key: Guid,
    /// The side-channel session that negotiated.
    pub session: SessionId,
    pub session_secret: SessionSecret,
    pub client_name: String,
    /// The client's own UUID from the negotiate request.
    pub client_key: Guid,
    /// The server instances offered to this client (both sides share them).
    pub offered: Vec<Instance>,
    pub expires: Instant,
}

/// Negotiate Keys one side-channel session may have outstanding; a further
/// Negotiate drops its oldest (a client negotiates once per RDMA channel
/// it is about to connect, and AUTHs at once).
pub const MAX_NEGOTIATIONS_PER_SESSION: usize = 16;

/// The negotiate table: Keys by value, in expiry order, and per session in
/// the order made, so that adding, expiring and ending a session touch only
/// the entries concerned (never a scan of the whole table).
#[derive(Default)]
struct Negotiations {
    by_key: HashMap<Guid, (NegotiatedClient, u64)>,
    /// (expiry, sequence number) → Key.
    by_expiry: BTreeMap<(Instant, u64), Guid>,
    /// Each session's Keys, oldest first.
    by_session: HashMap<SessionId, VecDeque<Guid>>,
    seq: u64,
}

impl Negotiations {
    fn remove(&mut self, key: &Guid) -> Option<NegotiatedClient> {
        let (n, seq) = self.by_key.remove(key)?;
        self.by_expiry.remove(&(n.expires, seq));
        if let Some(q) = self.by_session.get_mut(&n.session) {
            if let Some(i) = q.iter().position(|k| k == key) {
                q.remove(i);
            }
            if q.is_empty() {
                self.by_session.remove(&n.session);
            }
        }
        Some(n)
    }

    fn expire(&mut self, now: Instant) {
        while let Some((&(t, _), &key)) = self.by_expiry.first_key_value() {
            if t > now {
                break;
            }
            self.remove(&key);
        }
    }

    fn add(&mut self, n: NegotiatedClient) {
        self.expire(Instant::now());
        self.remove(&n.key);
        let q = self.by_session.entry(n.session).or_default();
        let oldest = (q.len() >= MAX_NEGOTIATIONS_PER_SESSION).then(|| q.front().copied());
        q.push_back(n.key);
        if let Some(Some(old)) = oldest {
            self.remove(&old);
        }
        self.seq += 1;
        self.by_expiry.insert((n.expires, self.seq), n.key);
        self.by_key.insert(n.key, (n, self.seq));
    }

    fn end_session(&mut self, id: SessionId) {
        for key in self.by_session.remove(&id).unwrap_or_default() {
            self.remove(&key);
        }
    }
}

/// Who may log in.
#[derive(Debug, Clone, Default)]
pub struct AuthPolicy {
    pub token: Option<Token>,
    pub allow_anonymous: bool,
}

/// Users, access lists and transport security of the side channel (what
/// [`AuthPolicy`] does not cover). `Default`: plain TCP, no users, every
/// export open to everyone who may log in — what [`Server::bind`] uses.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// TLS identity; `None` = plain TCP.
    pub tls: Option<ServerIdentity>,
    /// Configured users (password and/or per-user token).
    pub users: UserDb,
    /// Access list per export name; an export without one gets
    /// [`Acl::default`].
    pub acls: HashMap<String, Acl>,
    /// Accept password logins over plain TCP.
    pub allow_password_without_tls: bool,
}

impl Security {
    /// Users, access lists and the password policy from a config; the TLS
    /// identity is loaded separately (it may need creating).
    pub fn from_config(c: &Config, tls: Option<ServerIdentity>) -> Result<Security> {
        let users = c
            .user_db()
            .map_err(|e| Error::new(ErrorCode::InvalidArgument, e.0))?;
        Ok(Security {
            tls,
            users,
            acls: c.acls(),
            allow_password_without_tls: c.allow_password_without_tls,
        })
    }
}

/// Refuse a configuration nobody could log in to, or one with an access
/// list for an export it does not have.
fn check_security(auth: &AuthPolicy, exports: &[ExportSpec], security: &Security) -> Result<()> {
    if auth.token.is_none() && !auth.allow_anonymous && security.users.is_empty() {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            "no token, no users and anonymous access disabled: nobody could log in",
        ));
    }
    for name in security.acls.keys() {
        if !exports.iter().any(|e| &e.name == name) {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("access list for unknown export {name:?}"),
            ));
        }
    }
    Ok(())
}

/// What a reload replaces as one: the exports with their access lists, and
/// the users. A request checks its export and its rights on one snapshot
/// ([`ServerState::live`]).
#[derive(Debug)]
pub struct Live {
    pub exports: Arc<Exports>,
    /// Users, access lists, TLS (the TLS identity is the one read at
    /// start: a reload keeps it).
    pub security: Arc<Security>,
}

impl Live {
    /// Rights of `who` on `export`: none on an export this snapshot does
    /// not serve; else by its access list (a read-only export additionally
    /// refuses writes).
    pub fn rights(&self, export: &str, who: &Principal) -> Rights {
        if self.exports.get(export).is_err() {
            return Rights::default();
        }
        match self.security.acls.get(export) {
            Some(a) => a.rights(who),
            None => Acl::default().rights(who),
        }
    }
}

/// What [`ServerState::reload`] did: one line per change applied, one per
/// setting that needs a restart, and the sessions it ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reloaded {
    pub applied: Vec<String>,
    pub needs_restart: Vec<String>,
    pub sessions_ended: usize,
}

/// Cooperative shutdown, usable from async code and from threads.
#[derive(Clone, Default)]
pub struct Shutdown(Arc<ShutdownInner>);

#[derive(Default)]
struct ShutdownInner {
    flag: AtomicBool,
    notify: Notify,
    mu: Mutex<()>,
    cv: Condvar,
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shutdown({})", self.is_triggered())
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown::default()
    }
    /// Ask everything to stop. Idempotent.
    pub fn trigger(&self) {
        self.0.flag.store(true, Ordering::SeqCst);
        self.0.notify.notify_waiters();
        let _g = self.0.mu.lock().unwrap_or_else(|p| p.into_inner());
        self.0.cv.notify_all();
    }
    pub fn is_triggered(&self) -> bool {
        self.0.flag.load(Ordering::SeqCst)
    }
    /// Wait (async) until triggered.
    pub async fn wait(&self) {
        loop {
            let n = self.0.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_triggered() {
                return;
            }
            n.await;
        }
    }
    /// Wait (blocking) up to `timeout`; returns whether it was triggered.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let g = self.0.mu.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_triggered() {
            return true;
        }
        let _ = self.0.cv.wait_timeout(g, timeout);
        self.is_triggered()
    }
}

/// The RDMA phase (written separately): implemented by the RDMA listener and
/// attached with [`Server::set_rdma_phase`].
pub trait RdmaPhase: Send + Sync + 'static {
    /// The provider instances to advertise in negotiate responses: wire
    /// transport, address and policies of every listener (the addresses
    /// clients connect their RDMA channels to).
    fn endpoints(&self) -> Vec<Instance>;

    /// Serve RDMA connections until `shutdown` triggers. Called once by
    /// [`Server::run`] on a dedicated thread; it must return promptly after
    /// the trigger (poll [`Shutdown::is_triggered`] or block in
    /// [`Shutdown::wait_timeout`]).
    fn serve(&self, state: Arc<ServerState>, shutdown: Shutdown);

    /// Its figures for the metrics (`None`: it keeps none).
    fn snapshot(&self) -> Option<crate::metrics::RdmaSnapshot> {
        None
    }
}

/// State shared by the side channel and the RDMA phase.
pub struct ServerState {
    /// Server name sent in Hello and as the resume key Context.
    pub server_name: String,
    /// Exports, access lists and users: what a reload replaces
    /// ([`ServerState::reload`]); read one snapshot per check.
    live: RwLock<Arc<Live>>,
    /// How export roots are resolved (for exports a reload opens).
    resolve: ResolveMode,
    /// Sessions a reload ended (their user was removed, or its password
    /// or token changed): why, for the session's task to say.
    revoked: Mutex<HashMap<SessionId, String>>,
    /// Woken by a reload that ended sessions.
    pub(crate) revocations: Notify,
    pub open_files: OpenFileTable,
    /// Directory leases (docs/leases.md).
    pub leases: Arc<crate::side_service::leases::Leases>,
    /// Breaks for changes made on the server's own file system (None:
    /// fanotify not allowed here).
    pub dir_watch: Option<Arc<crate::side_service::dirwatch::DirWatch>>,
    /// Published memory objects (docs/memory-objects.md).
    pub mem_objects: Arc<crate::memobj::MemObjects>,
    pub backend: Arc<dyn Backend>,
    pub limits: Limits,
    /// Configured provider choice for the RDMA phase.
    pub provider: ProviderChoice,
    pub(crate) auth: AuthPolicy,
    /// Connection admission (per-host caps, rate limits).
    pub admission: Arc<Admission>,
    /// Bounds concurrent argon2 verifications (CPU and memory).
    pub(crate) password_checks: Arc<tokio::sync::Semaphore>,
    sessions: Mutex<HashMap<SessionId, SessionInfo>>,
    /// Sessions whose side channel is gone but whose open files are kept
    /// for `limits.durable_grace` (docs/reconnect.md): who may take them
    /// back, and until when.
    durable: Mutex<HashMap<SessionId, (SessionInfo, Instant)>>,
    negotiations: Mutex<Negotiations>,
    rdma_endpoints: RwLock<Vec<Instance>>,
    next_session: AtomicU64,
    /// The RDMA phase, for its metrics.
    rdma_phase: std::sync::OnceLock<Arc<dyn RdmaPhase>>,
}

impl std::fmt::Debug for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerState")
            .field("server_name", &self.server_name)
            .field("exports", &self.exports().len())
            .field("backend", &self.backend.kind())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ServerState {
    /// For REGISTER: the open file behind a resume key, if issued to `session`
    /// and not expired.
    pub fn lookup_resume_key(
        &self,
        key: &SrvResumeKey,
        session: SessionId,
    ) -> Result<OpenFile, Denied> {
        self.open_files.lookup_resume_key(key, session)
    }

    /// For AUTH: who negotiated `key`, while the key is fresh and that
    /// side-channel session is still logged in.
    pub fn lookup_negotiate_key(&self, key: &Guid) -> Option<NegotiatedClient> {
        let n = lock(&self.negotiations).by_key.get(key)?.0.clone();
        if Instant::now() >= n.expires || !lock(&self.sessions).contains_key(&n.session) {
            return None;
        }
        Some(n)
    }

    /// Rights of `who` on export `export` (by its access list only; a
    /// read-only export additionally refuses writes).
    pub fn rights(&self, export: &str, who: &Principal) -> Rights {
        self.live().rights(export, who)
    }

    /// The exports, access lists and users now in force (one consistent
    /// snapshot; a reload swaps in a new one).
    pub fn live(&self) -> Arc<Live> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The exports now served.
    pub fn exports(&self) -> Arc<Exports> {
        self.live().exports.clone()
    }

    /// Users, access lists and TLS now in force.
    pub fn security(&self) -> Arc<Security> {
        self.live().security.clone()
    }

    /// Why session `id` was ended by a reload, if it was.
    pub fn revoked(&self, id: SessionId) -> Option<String> {
        lock(&self.revoked).get(&id).cloned()
    }

    /// Logged-in sessions of `who`.
    pub fn sessions_of(&self, who: &Principal) -> usize {
        lock(&self.sessions)
            .values()
            .filter(|s| &s.principal == who)
            .count()
    }

    /// Lost sessions of `who` whose open files are kept.
    pub fn durable_sessions_of(&self, who: &Principal) -> usize {
        lock(&self.durable)
            .values()
            .filter(|(s, _)| &s.principal == who)
            .count()
    }

    /// Before a login of `who`: refuse it if `who` already has
    /// `max_sessions_per_user` live sessions; else, if its live and kept
    /// (lost, durable) sessions together reach the limit, close the files
    /// of its oldest kept sessions to make room. Kept sessions count
    /// against the limit like live ones, so a user cannot hold more than
    /// `max_sessions_per_user` sessions' worth of open files by dropping
    /// connections; dropping the oldest rather than refusing keeps a
    /// client that crashes and restarts from locking itself out for the
    /// grace period (as the Linux NFS server's "courteous" clients: state
    /// kept past a lost lease is given up when it is needed).
    pub(crate) fn make_room_for(&self, who: &Principal) -> Result<()> {
        let max = self.limits.max_sessions_per_user;
        let live = self.sessions_of(who);
        if live >= max {
            return Err(Error::new(
                ErrorCode::Busy,
                format!(
                    "{} already has {live} sessions (limit {max})",
                    who.describe()
                ),
            ));
        }
        let dropped: Vec<SessionId> = {
            let mut d = lock(&self.durable);
            let mut kept: Vec<(Instant, SessionId)> = d
                .iter()
                .filter(|(_, (s, _))| &s.principal == who)
                .map(|(id, (_, until))| (*until, *id))
                .collect();
            kept.sort_unstable();
            let over = (live + kept.len() + 1).saturating_sub(max);
            kept.truncate(over);
            for (_, id) in &kept {
                d.remove(id);
            }
            kept.into_iter().map(|(_, id)| id).collect()
        };
        for id in dropped {
            let n = self.open_files.close_session(id);
            tracing::info!(
                session = id,
                files = n,
                who = %who,
                "a new login of the user needs the room: closed a lost session's kept files"
            );
        }
        Ok(())
    }

    /// A logged-in session.
    pub fn session(&self, id: SessionId) -> Option<SessionInfo> {
        lock(&self.sessions).get(&id).cloned()
    }

    /// Number of logged-in sessions.
    /// The RDMA phase's figures for the metrics, if it has one.
    pub fn rdma_snapshot(&self) -> Option<crate::metrics::RdmaSnapshot> {
        self.rdma_phase.get().and_then(|p| p.snapshot())
    }

    pub fn session_count(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// Provider instances advertised in negotiate responses.
    pub fn rdma_endpoints(&self) -> Vec<Instance> {
        self.rdma_endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the advertised endpoints (the RDMA phase, once listening).
    pub fn set_rdma_endpoints(&self, v: Vec<Instance>) {
        *self
            .rdma_endpoints
            .write()
            .unwrap_or_else(|p| p.into_inner()) = v;
    }

    pub(crate) fn register_session(&self, mut info: SessionInfo) -> SessionId {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        info.id = id;
        lock(&self.sessions).insert(id, info);
        id
    }

    /// Session `id` is no longer logged in: its entry, leases, published
    /// memory objects and pending negotiations go (its open files are the
    /// caller's to keep or close).
    fn release_session(&self, id: SessionId) -> Option<SessionInfo> {
        let info = lock(&self.sessions).remove(&id);
        self.leases.end_session(id);
        self.mem_objects.end_session(id);
        lock(&self.negotiations).end_session(id);
        info
    }

    /// Take out of the durable sessions those `pick` chooses.
    fn take_durable(&self, pick: impl Fn(&SessionInfo, Instant) -> bool) -> Vec<SessionId> {
        let mut d = lock(&self.durable);
        let ids: Vec<SessionId> = d
            .iter()
            .filter(|(_, (s, t))| pick(s, *t))
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            d.remove(id);
        }
        ids
    }

    pub(crate) fn end_session(&self, id: SessionId) {
        let info = self.release_session(id);
        let grace = self.limits.durable_grace;
        let kept = self.open_files.session_len(id);
        if let (Some(info), false, true) = (info, grace.is_zero(), kept > 0) {
            // Durable handles: the files stay open for the client to take
            // back with `Resume` (docs/reconnect.md).
            tracing::info!(session = id, files = kept, grace = ?grace, "session lost; keeping its open files");
            lock(&self.durable).insert(id, (info, Instant::now() + grace));
            return;
        }
        let n = self.open_files.close_session(id);
        if n > 0 {
            tracing::debug!(session = id, files = n, "closed files of ended session");
        }
    }

    /// `Resume`: session `new` (logged in as `who`) takes over the open
    /// files of session `old`, lost (kept for the grace period) or still
    /// logged in, if `old` is `who`'s and `mac` proves its secret. The
    /// refusal is the same whatever the reason (no session enumeration).
    pub(crate) fn resume(
        &self,
        new: SessionId,
        who: &crate::side_service::access::Principal,
        old: SessionId,
        mac: &[u8],
    ) -> Result<usize, lwio_side::Error> {
        let refused = || {
            lwio_side::Error::new(
                lwio_side::error::ErrorCode::PermissionDenied,
                RESUME_REFUSED,
            )
        };
        if old == new {
            return Err(refused());
        }
        // The proof names the adopting session's own login nonce.
        let nonce = self.session(new).ok_or_else(refused)?.nonce;
        let ok = |info: &SessionInfo| {
            &info.principal == who
                && lwio_side::auth::verify_resume_mac(&info.secret, old, &nonce, mac)
        };
        // The adopting session stays within `max_open_files_per_session`
        // (`adopt` refuses otherwise, and a lost session then stays kept).
        let n = {
            let mut d = lock(&self.durable);
            match d.get(&old) {
                Some((info, _)) if ok(info) => {
                    let n = self.open_files.adopt(old, new)?;
                    d.remove(&old);
                    n
                }
                Some(_) => return Err(refused()),
                None => {
                    drop(d);
                    let live = self.session(old).ok_or_else(refused)?;
                    if !ok(&live) {
                        return Err(refused());
                    }
                    self.open_files.adopt(old, new)?
                }
            }
        };
        tracing::info!(
            session = new,
            from = old,
            files = n,
            "resumed durable handles"
        );
        Ok(n)
    }

    /// Close the files of lost sessions whose grace period is over; returns
    /// how many sessions expired.
    pub fn expire_durable(&self) -> usize {
        let now = Instant::now();
        let gone = self.take_durable(|_, deadline| deadline <= now);
        for id in &gone {
            let n = self.open_files.close_session(*id);
            tracing::info!(
                session = id,
                files = n,
                "durable grace over; closed the lost session's files"
            );
        }
        gone.len()
    }

    /// SIGHUP: serve `new`'s exports, access lists and users from now on,
    /// in place of `old`'s (both flag-merged and validated; `old` is what
    /// runs). Nothing changes on an error (an export root that cannot be
    /// opened, a configuration nobody could log in to).
    ///
    /// Added exports are reachable by new requests; a removed export
    /// answers new requests as an unknown one, while the files already
    /// open on it keep working until closed (as `exportfs -r`); changed
    /// export options and access lists apply to new requests. Users added
    /// may log in; the sessions of a user removed, or whose password or
    /// token changed, are ended (their open files closed, nothing kept
    /// for a resume) and their next login is checked against the new
    /// list. Every other setting needs a restart and is only reported.
    pub fn reload(&self, old: &Config, new: &Config) -> Result<Reloaded> {
        let mut out = Reloaded {
            needs_restart: old
                .restart_changes(new)
                .into_iter()
                .map(|k| format!("needs a restart: {k}"))
                .collect(),
            ..Reloaded::default()
        };
        let users = new
            .user_db()
            .map_err(|e| Error::new(ErrorCode::InvalidArgument, e.0))?;
        let specs = new.export_specs();
        let cur = self.live();
        let security = Security {
            tls: cur.security.tls.clone(),
            users,
            acls: new.acls(),
            allow_password_without_tls: cur.security.allow_password_without_tls,
        };
        check_security(&self.auth, &specs, &security)?;
        let exports = Arc::new(Exports::open(&specs, self.resolve)?);
        for (name, e) in &new.exports {
            let path = specs
                .iter()
                .find(|s| &s.name == name)
                .map(|s| s.path.display().to_string())
                .unwrap_or_default();
            match old.exports.get(name) {
                None => out
                    .applied
                    .push(format!("export added: {name} path={path}")),
                Some(o) if o != e => out
                    .applied
                    .push(format!("export changed: {name} path={path}")),
                Some(_) => {}
            }
        }
        for name in old.exports.keys().filter(|n| !new.exports.contains_key(*n)) {
            out.applied.push(format!("export removed: {name}"));
        }
        // Users whose sessions end: removed, or another password or token.
        let mut ended_users = Vec::new();
        for (name, u) in &old.users {
            match new.users.get(name) {
                None => ended_users.push((
                    name.clone(),
                    "removed",
                    "was removed from the configuration",
                )),
                Some(n) if n.password != u.password || n.token != u.token => {
                    ended_users.push((name.clone(), "changed", "has a new password or token"))
                }
                Some(n) if n != u => out.applied.push(format!("user changed: {name} (ids)")),
                Some(_) => {}
            }
        }
        for name in new.users.keys().filter(|n| !old.users.contains_key(*n)) {
            out.applied.push(format!("user added: {name}"));
        }
        // Swap first: from here on a login and a request see the new lists.
        *self.live.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Live {
            exports,
            security: Arc::new(security),
        });
        for (name, verb, why) in ended_users {
            let who = Principal::User(name.clone());
            let reason = format!("session ended: user {name} {why} (server reload)");
            let live: Vec<SessionId> = lock(&self.sessions)
                .iter()
                .filter(|(_, s)| s.principal == who)
                .map(|(id, _)| *id)
                .collect();
            let kept = self.take_durable(|s, _| s.principal == who);
            for id in &live {
                lock(&self.revoked).insert(*id, reason.clone());
                self.release_session(*id);
            }
            let mut files = 0;
            for id in live.iter().chain(&kept) {
                files += self.open_files.close_session(*id);
            }
            out.applied.push(format!(
                "user {verb}: {name} ({} sessions ended, {files} open files closed)",
                live.len() + kept.len()
            ));
            out.sessions_ended += live.len() + kept.len();
        }
        if out.sessions_ended > 0 {
            self.revocations.notify_waiters();
        }
        Ok(out)
    }

    /// The session's task is done with a session a reload ended.
    pub(crate) fn forget_revoked(&self, id: SessionId) {
        lock(&self.revoked).remove(&id);
    }

    /// Lost sessions whose open files are still kept.
    pub fn durable_sessions(&self) -> usize {
        lock(&self.durable).len()
    }

    /// Negotiate Keys outstanding (not yet expired or dropped).
    pub fn negotiation_count(&self) -> usize {
        lock(&self.negotiations).by_key.len()
    }

    /// Remember a negotiate Key for the RDMA AUTH: until it expires, its
    /// session ends, or the session has made
    /// [`MAX_NEGOTIATIONS_PER_SESSION`] newer ones.
    pub(crate) fn add_negotiation(&self, n: NegotiatedClient) {
        lock(&self.negotiations).add(n);
    }
}

/// Everything needed to start a server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub listen: String,
    pub server_name: String,
    pub exports: Vec<ExportSpec>,
    pub auth: AuthPolicy,
    pub limits: Limits,
    pub io: IoConfig,
    pub provider: ProviderChoice,
    pub resolve: ResolveMode,
}

impl ServerOptions {
    /// Options from a (flag-merged) config and the loaded token.
    pub fn from_config(c: &Config, token: Option<Token>) -> ServerOptions {
        ServerOptions {
            listen: c.listen.clone(),
            server_name: c.server_name.clone().unwrap_or_else(host_name),
            exports: c.export_specs(),
            auth: AuthPolicy {
                token,
                allow_anonymous: c.allow_anonymous,
            },
            limits: c.limits.clone(),
            io: c.io.clone(),
            provider: c.provider,
            resolve: ResolveMode::Auto,
        }
    }
}

/// The server: bound side-channel listener + state + optional RDMA phase.
pub struct Server {
    state: Arc<ServerState>,
    listener: TcpListener,
    shutdown: Shutdown,
    rdma: Option<Arc<dyn RdmaPhase>>,
}

impl Server {
    /// Open exports and the I/O backend, bind the side channel (plain TCP,
    /// no users: [`Security::default`]).
    pub async fn bind(opts: ServerOptions) -> Result<Server> {
        Server::bind_secure(opts, Security::default()).await
    }

    /// [`Server::bind`] with users, access lists and TLS.
    pub async fn bind_secure(opts: ServerOptions, security: Security) -> Result<Server> {
        check_security(&opts.auth, &opts.exports, &security)?;
        if opts.server_name.is_empty()
            || opts.server_name.encode_utf16().count() > crate::fs::table::MAX_SERVER_NAME
        {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "server name {:?} must be 1 to {} characters",
                    opts.server_name,
                    crate::fs::table::MAX_SERVER_NAME
                ),
            ));
        }
        let exports = Exports::open(&opts.exports, opts.resolve)?;
        let live = RwLock::new(Arc::new(Live {
            exports: Arc::new(exports),
            security: Arc::new(security),
        }));
        let backend = open_backend(opts.io.backend, opts.io.workers)
            .map_err(|e| Error::from_io(&e, "file I/O backend"))?;
        let listener = TcpListener::bind(&opts.listen)
            .await
            .map_err(|e| Error::from_io(&e, format!("cannot listen on {}", opts.listen)))?;
        let leases = Arc::new(crate::side_service::leases::Leases::new(&opts.limits));
        let state = Arc::new(ServerState {
            server_name: opts.server_name.clone(),
            live,
            resolve: opts.resolve,
            revoked: Mutex::new(HashMap::new()),
            revocations: Notify::new(),
            open_files: OpenFileTable::new(
                opts.limits.resume_key_ttl,
                opts.limits.max_open_files_per_session,
                opts.server_name.clone(),
            )
            .with_caps(opts.limits.max_open_files, opts.limits.max_open_descriptors)
            .with_lock_caps(
                opts.limits.max_lock_owners_per_file,
                opts.limits.max_lock_owners_per_session,
            ),
            leases: leases.clone(),
            dir_watch: crate::side_service::dirwatch::DirWatch::start(
                leases,
                opts.limits.max_leases,
            ),
            mem_objects: Arc::default(),
            backend,
            limits: opts.limits.clone(),
            provider: opts.provider,
            auth: opts.auth.clone(),
            admission: Arc::new(Admission::new(&opts.limits)),
            password_checks: Arc::new(tokio::sync::Semaphore::new(2)),
            sessions: Mutex::new(HashMap::new()),
            durable: Mutex::new(HashMap::new()),
            negotiations: Mutex::new(Negotiations::default()),
            rdma_endpoints: RwLock::new(Vec::new()),
            next_session: AtomicU64::new(1),
            rdma_phase: std::sync::OnceLock::new(),
        });
        for e in state.exports().iter() {
            tracing::info!(
                export = %e.name,
                path = %e.root.display(),
                read_only = e.read_only,
                resolver = ?e.resolve_mode(),
                reopen_by_handle = e.reopens_by_handle(),
                "export"
            );
        }
        tracing::info!(
            max_open_files = opts.limits.max_open_files,
            max_open_descriptors = state.open_files.descriptors().max(),
            "open files"
        );
        Ok(Server {
            state,
            listener,
            shutdown: Shutdown::new(),
            rdma: None,
        })
    }

    /// The bound side-channel address (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// A handle whose `trigger()` stops [`Server::run`] gracefully.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Attach the RDMA phase (hook for the RDMA listener).
    pub fn set_rdma_phase(&mut self, phase: Arc<dyn RdmaPhase>) {
        let _ = self.state.rdma_phase.set(phase.clone());
        self.rdma = Some(phase);
    }

    /// Serve until the shutdown handle triggers: stop accepting, let in-flight
    /// requests finish (up to `limits.shutdown_grace`), close sessions, stop
    /// the RDMA phase.
    pub async fn run(self) -> Result<()> {
        let Server {
            state,
            listener,
            shutdown,
            rdma,
        } = self;
        let rdma_thread = match rdma {
            Some(phase) => {
                state.set_rdma_endpoints(phase.endpoints());
                let (st, sd) = (state.clone(), shutdown.clone());
                Some(
                    std::thread::Builder::new()
                        .name("lwio-rdma".into())
                        .spawn(move || phase.serve(st, sd))
                        .map_err(|e| Error::from_io(&e, "starting the RDMA phase"))?,
                )
            }
            None => {
                tracing::info!("RDMA phase not in this build: negotiate will offer no providers");
                None
            }
        };
        // Durable handles past their grace period are closed within a
        // quarter of it (at least every 50 ms, at most every second).
        let reaper = {
            let (st, sd) = (state.clone(), shutdown.clone());
            let every = (st.limits.durable_grace / 4)
                .clamp(Duration::from_millis(50), Duration::from_secs(1));
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = sd.wait() => break,
                        _ = tokio::time::sleep(every) => { st.expire_durable(); }
                    }
                }
            })
        };
        crate::side_service::accept_loop(listener, state.clone(), shutdown.clone()).await;
        reaper.abort();
        shutdown.trigger();
        if let Some(t) = rdma_thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        tracing::info!("server stopped");
        Ok(())
    }
}
