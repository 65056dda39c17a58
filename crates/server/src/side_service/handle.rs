//! The requests of a logged-in session: access checks, identities and
//! bounds, lease breaks, watches, and the handler of each request.

use super::*;

pub(super) fn denied(who: &Principal, verb: &str, export: &str) -> Error {
    Error::new(
        ErrorCode::PermissionDenied,
        format!("{} may not {verb} export {export}", who.describe()),
    )
}

/// `Ok` if `who` has the rights `need` on `export`.
/// One page of a listing from `cookie` (the index of its first entry): as
/// many entries as fit in `budget` bytes (at least one), and the next
/// cookie (0 = done).
pub(super) fn page<T>(
    all: &[T],
    cookie: u64,
    budget: usize,
    len: impl Fn(&T) -> usize,
) -> (&[T], u64) {
    let start = usize::try_from(cookie).unwrap_or(usize::MAX).min(all.len());
    let mut used = 0;
    let mut n = 0;
    for e in &all[start..] {
        used += len(e);
        if used > budget && n > 0 {
            break;
        }
        n += 1;
    }
    let next = start + n;
    (
        &all[start..next],
        if next < all.len() { next as u64 } else { 0 },
    )
}

pub(super) fn check(
    state: &ServerState,
    who: &Principal,
    export: &str,
    need: Rights,
) -> Result<(), Error> {
    // Unknown exports answer NoSuchExport first; both on one snapshot of
    // the configuration (a reload swaps it).
    let live = state.live();
    live.exports.get(export)?;
    let have = live.rights(export, who);
    if need.write && !have.write {
        return Err(denied(who, "write to", export));
    }
    if need.read && !have.read {
        return Err(denied(who, "read", export));
    }
    Ok(())
}

pub(super) const READ: Rights = Rights {
    read: true,
    write: false,
};
pub(super) const WRITE: Rights = Rights {
    read: false,
    write: true,
};

/// Run a blocking filesystem call off the async threads.
pub(super) async fn blocking<T, F>(f: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(Error::new(ErrorCode::Io, format!("internal error: {e}"))))
}

/// [`blocking`], as `ids` (`None`: as the server) for the whole call.
pub(super) async fn blocking_as<T, F>(ids: Option<Creds>, f: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    blocking(move || as_caller(ids.as_ref(), f)).await
}

/// On an `identity = "server"` export, what a client asks is bounded to
/// what the server's own user could make ([`crate::fs::ids::server_bounds`]):
/// no set-id bits, no chown to anyone else.
pub(super) fn server_bounds(
    state: &ServerState,
    session: u64,
    mut req: Request,
) -> Result<Request, Error> {
    use crate::fs::ids::{strip_setid, IdentityMode};
    let by_server = |export: &str| {
        state
            .exports()
            .get(export)
            .is_ok_and(|e| e.identity.mode == IdentityMode::Server)
    };
    match &mut req {
        Request::Open { export, mode, .. }
        | Request::Mkdir { export, mode, .. }
        | Request::Mknod { export, mode, .. }
            if by_server(export) =>
        {
            *mode = strip_setid(*mode)
        }
        Request::SetAttr { export, path, set } if by_server(export) => {
            crate::fs::ids::server_bounds(set, &format!("{export}/{path}"))?
        }
        Request::SetAttrHandle { handle, set } => {
            if let Ok(f) = state.open_files.get(*handle, session) {
                if by_server(&f.export) {
                    crate::fs::ids::server_bounds(set, &format!("{}/{}", f.export, f.path))?
                }
            }
        }
        _ => {}
    }
    Ok(req)
}

/// The ids a call of `who` on `ex` runs as (docs/mount.md,
/// "Identities"): `None` on an `identity = "server"` export.
pub(super) fn ids_for(
    state: &ServerState,
    who: &Principal,
    creds: Option<&Creds>,
    ex: &Export,
) -> Result<Option<Creds>, Error> {
    let configured = match who {
        Principal::User(u) => state.security().users.get(u).and_then(|c| c.ids),
        _ => None,
    };
    ex.identity.resolve(
        &ex.name,
        &Caller {
            login: (*who != Principal::Anonymous).then(|| who.name()),
            is_user: matches!(who, Principal::User(_)),
            asserted: creds,
            configured,
        },
    )
}

/// The directories a request changes (docs/leases.md, "What breaks a
/// lease"): none for a request that changes nothing, or that its sender may
/// not make (it fails without touching anything, and breaks nothing).
pub(super) fn touches(state: &ServerState, session: u64, who: &Principal, req: &Request) -> Change {
    let mut c = Change::default();
    let may_write = |export: &str| state.rights(export, who).write;
    let parent = |c: &mut Change, export: &str, path: &str| {
        if let Ok(Some(k)) = leases::parent_key(export, path) {
            c.dirs.push(k);
        }
    };
    let of_handle = |c: &mut Change, handle: u64| {
        if let Ok(f) = state.open_files.get(handle, session) {
            if f.rights.write {
                if let Ok(Some(k)) = leases::parent_key(&f.export, &f.path) {
                    c.dirs.push(k);
                }
            }
        }
    };
    match req {
        // Written through the data path, the entry's size and times change
        // where the server does not look: break at open.
        Request::Open {
            export,
            path,
            access,
            flags,
            ..
        } if (access & ACCESS_WRITE != 0 || flags & (OPEN_CREATE | OPEN_TRUNCATE) != 0)
            && may_write(export) =>
        {
            parent(&mut c, export, path)
        }
        Request::Remove { export, path }
        | Request::Remove2 { export, path, .. }
        | Request::SetAttr { export, path, .. }
        | Request::Symlink { export, path, .. }
        | Request::Mknod { export, path, .. }
            if may_write(export) =>
        {
            parent(&mut c, export, path)
        }
        Request::Mkdir {
            export,
            path,
            parents,
            ..
        } if may_write(export) => {
            // With `parents`, every level may be created: each one's parent.
            if let Ok(comps) = crate::fs::split_rel_path(path) {
                let first = if *parents { 1 } else { comps.len().max(1) };
                for n in first..=comps.len() {
                    c.dirs.push((export.clone(), comps[..n - 1].join("/")));
                }
            }
        }
        Request::Link { export, from, to } if may_write(export) => {
            // The source's link count changes too.
            parent(&mut c, export, from);
            parent(&mut c, export, to);
        }
        Request::Rename {
            export, from, to, ..
        }
        | Request::Rename2 {
            export, from, to, ..
        } if may_write(export) => {
            parent(&mut c, export, from);
            parent(&mut c, export, to);
            // Leases on the moved directories (and below) name old paths.
            for p in [from, to] {
                if let Ok(k) = leases::dir_key(export, p) {
                    if !k.1.is_empty() {
                        c.trees.push(k);
                    }
                }
            }
        }
        Request::SetSize { handle, .. }
        | Request::SetAttrHandle { handle, .. }
        | Request::Fallocate { handle, .. } => of_handle(&mut c, *handle),
        Request::CopyRange { dst, .. } => of_handle(&mut c, *dst),
        _ => {}
    }
    c.dirs.sort();
    c.dirs.dedup();
    c
}

/// How long a `Rekey` waits for the file's previous RDMA connection to let
/// go of it (its requests in flight finish, its Fid table is dropped).
pub const REKEY_DRAIN: Duration = Duration::from_secs(10);

/// `Rekey`: a fresh resume key for an open file, once no earlier RDMA
/// connection holds the file any more. That wait is the server's half of
/// the ordering rule of docs/reconnect.md: a WRITE sent on a lost
/// connection is applied (or dropped) before the file can be registered on
/// the next one, so a re-sent WRITE, and every later one, lands after it.
pub(super) async fn rekey(
    state: &Arc<ServerState>,
    session: u64,
    handle: u64,
) -> Result<Response, Error> {
    let until = Instant::now() + REKEY_DRAIN;
    let mut waited = false;
    loop {
        match state.open_files.in_use(handle, session) {
            None => {
                return Err(Error::new(
                    ErrorCode::BadHandle,
                    format!("no open file with handle {handle}"),
                ))
            }
            Some(false) => break,
            Some(true) if !waited => {
                waited = true;
                state.open_files.note_rekey_wait(false);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Some(true) if Instant::now() >= until => {
                state.open_files.note_rekey_wait(true);
                return Err(Error::new(
                    ErrorCode::Busy,
                    format!(
                        "handle {handle} is still held by an earlier RDMA connection after {REKEY_DRAIN:?}"
                    ),
                ));
            }
            Some(true) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    let (file, rk) = state.open_files.rekey(handle, session)?;
    blocking(move || {
        let size = file.fd()?.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(opened_response(&file, &rk, size))
    })
    .await
}

/// The `Opened` answer for an open file (`Open`, `Rekey`): its handle, size,
/// alignment, resume key and file id.
pub(super) fn opened_response(
    file: &crate::fs::table::OpenFile,
    rk: &crate::fs::table::SrvRequestResumeKey,
    size: u64,
) -> Response {
    Response::Opened {
        handle: file.handle,
        size,
        align: file.align,
        resume_key: crate::fs::table::encode_request_resume_key(rk),
        file_id: file.fid.ident(),
    }
}

/// Check a `WatchBreaks`: session `target` is logged in as the same
/// principal, and `mac` proves its secret.
pub(super) fn watch_check(
    state: &ServerState,
    who: &Principal,
    current: u64,
    target: u64,
    mac: &[u8],
) -> Result<(), Error> {
    let refused = || {
        Error::new(
            ErrorCode::PermissionDenied,
            "watch refused: no such session of yours, or a wrong proof",
        )
    };
    let info = state.session(target).ok_or_else(refused)?;
    // The proof names the asking connection's own login nonce.
    let nonce = state.session(current).ok_or_else(refused)?.nonce;
    if &info.principal != who || !auth::verify_breaks_mac(&info.secret, target, &nonce, mac) {
        return Err(refused());
    }
    Ok(())
}

/// A watching connection: carry session `target`'s lease breaks to its
/// client and their acknowledgements back, until either side goes (the
/// session ending closes it; no idle timeout: it lives as long as the
/// session it serves).
pub(super) async fn watch<S>(
    state: Arc<ServerState>,
    stream: S,
    target: u64,
    peer: SocketAddr,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    enum Ev {
        Ack(u64),
        Ping(u32),
    }
    let (gen, mut breaks) = state.leases.watch(target);
    info!(%peer, session = target, "watching for lease breaks");
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (ev_tx, mut ev) = tokio::sync::mpsc::unbounded_channel();
    let max = state.limits.max_frame;
    // One reader future, polled across the loop (never dropped halfway
    // through a frame).
    let reader = async move {
        loop {
            let body = match read_frame(&mut rd, max).await {
                Ok(Some(b)) => b,
                _ => return,
            };
            let e = match Request::decode(&body) {
                Ok((_, Request::LeaseBreakAck { lease_id })) => Ev::Ack(lease_id),
                Ok((id, Request::Ping)) => Ev::Ping(id),
                Ok((_, Request::Bye)) => return,
                other => {
                    warn!(%peer, request = ?other.map(|r| r.1), "not a watch message; closing");
                    return;
                }
            };
            if ev_tx.send(e).is_err() {
                return;
            }
        }
    };
    tokio::pin!(reader);
    let mut pending: std::collections::HashMap<u64, tokio::sync::oneshot::Sender<()>> =
        std::collections::HashMap::new();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            _ = &mut reader => break,
            e = ev.recv() => match e {
                Some(Ev::Ack(id)) => {
                    if let Some(a) = pending.remove(&id) {
                        let _ = a.send(());
                    }
                }
                Some(Ev::Ping(id)) => {
                    if write_frame(&mut wr, &Response::Ok.encode(id)).await.is_err() {
                        break;
                    }
                }
                None => break,
            },
            m = breaks.recv() => match m {
                Some(b) => {
                    let f = Response::LeaseBreak {
                        lease_id: b.lease_id,
                        export: b.export,
                        path: b.path,
                    }
                    .encode(0);
                    pending.retain(|_, a| !a.is_closed());
                    pending.insert(b.lease_id, b.ack);
                    if write_frame(&mut wr, &f).await.is_err() {
                        break;
                    }
                }
                // The session ended.
                None => break,
            },
        }
    }
    state.leases.unwatch(target, gen);
    info!(%peer, session = target, "watching connection closed");
}

pub(super) async fn handle(
    state: &Arc<ServerState>,
    session: u64,
    who: &Principal,
    creds: Option<&Creds>,
    req: Request,
) -> Result<Response, Error> {
    // The export a request names, and the ids its call runs as.
    let export_as = |export: &str| -> Result<(Arc<Export>, Option<Creds>), Error> {
        let ex = state.exports().get(export)?.clone();
        let ids = ids_for(state, who, creds, &ex)?;
        Ok((ex, ids))
    };
    let req = server_bounds(state, session, req)?;
    if let Some(r) = mem::intercept(state, session, who, &req) {
        return r;
    }
    match req {
        Request::Unpublish { export, name } => {
            let o = state.mem_objects.unpublish(session, &export, &name)?;
            mem::quiesce(&o).await;
            Ok(Response::Ok)
        }
        Request::WaitWrites {
            export,
            name,
            seen,
            timeout_ms,
        } => {
            let o = state.mem_objects.get(&export, &name)?;
            if o.session != session {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "only the publisher waits for writes into its object",
                ));
            }
            let t = Duration::from_millis(u64::from(timeout_ms.min(60_000)));
            Ok(Response::Writes(o.wait_writes(seen, t).await))
        }
        Request::Publish { .. } => Err(Error::new(
            ErrorCode::BadRequest,
            "memory-object request not handled",
        )),
        Request::Hello { .. } | Request::Login(_) => {
            Err(Error::new(ErrorCode::BadRequest, "already logged in"))
        }
        Request::Ping | Request::Bye => Ok(Response::Ok),
        Request::ListExports => Ok(Response::Exports(
            state
                .exports()
                .iter()
                .filter_map(|e| {
                    let r = state.rights(&e.name, who);
                    (r.read || r.write).then(|| ExportInfo {
                        name: e.name.clone(),
                        read_only: e.read_only || !r.write,
                    })
                })
                .collect(),
        )),
        Request::ListDir {
            export,
            path,
            cookie,
        } => {
            check(state, who, &export, READ)?;
            let (ex, ids) = export_as(&export)?;
            let budget = (state.limits.max_frame as usize).saturating_sub(64);
            blocking_as(ids, move || {
                let all: Vec<WireDirEntry> = ex
                    .list(&path)?
                    .into_iter()
                    .map(|e| WireDirEntry {
                        name: e.name,
                        attr: e.attr,
                    })
                    .collect();
                let (page, next_cookie) = page(&all, cookie, budget, dir_entry_len);
                Ok(Response::DirPage {
                    entries: page.to_vec(),
                    next_cookie,
                })
            })
            .await
        }
        Request::Stat { export, path } => {
            check(state, who, &export, READ)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || Ok(Response::Attr(ex.stat(&path)?))).await
        }
        Request::Open {
            export,
            path,
            access,
            flags,
            mode,
        } => {
            let o = OpenOptions {
                read: access & ACCESS_READ != 0,
                write: access & ACCESS_WRITE != 0,
                create: flags & OPEN_CREATE != 0,
                exclusive: flags & OPEN_EXCLUSIVE != 0,
                truncate: flags & OPEN_TRUNCATE != 0,
                no_buffering: flags & OPEN_NO_BUFFERING != 0,
                write_through: flags & OPEN_WRITE_THROUGH != 0,
                sync: flags & OPEN_SYNC != 0,
            };
            let need = Rights {
                read: o.read,
                write: o.write || o.create || o.truncate,
            };
            check(state, who, &export, need)?;
            let (ex, ids) = export_as(&export)?;
            if state.open_files.session_len(session) >= state.limits.max_open_files_per_session {
                return Err(Error::new(
                    ErrorCode::TooManyOpenFiles,
                    format!(
                        "too many open files in this session (limit {})",
                        state.limits.max_open_files_per_session
                    ),
                ));
            }
            let st = state.clone();
            blocking(move || {
                let opened = as_caller(ids.as_ref(), || ex.open_file(&path, &o, mode))?;
                let size = opened.size;
                let rights = Rights {
                    read: o.read,
                    write: o.write,
                };
                let (file, rk) =
                    st.open_files
                        .insert(session, opened, rights, &ex.name, &path, Some(&ex))?;
                debug!(session, export = %ex.name, %path, handle = file.handle, "open");
                Ok(opened_response(&file, &rk, size))
            })
            .await
        }
        Request::Close { handle } => {
            state.open_files.close(handle, session)?;
            Ok(Response::Ok)
        }
        Request::Remove { export, path } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || ex.remove(&path).map(|_| Response::Ok)).await
        }
        Request::Rename {
            export,
            from,
            to,
            replace,
        } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                ex.rename(&from, &to, replace).map(|_| Response::Ok)
            })
            .await
        }
        Request::Mkdir {
            export,
            path,
            mode,
            parents,
        } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                ex.mkdir(&path, mode, parents).map(|_| Response::Ok)
            })
            .await
        }
        Request::SetSize { handle, size } => {
            let f = state.open_files.get(handle, session)?;
            if !f.rights.write {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "set-size needs a file opened for writing",
                ));
            }
            // As the caller: a truncate by another user clears S_ISUID.
            let (_, ids) = export_as(&f.export)?;
            blocking(move || {
                let fd = f.fd()?;
                as_caller(ids.as_ref(), || {
                    fd.set_len(size)
                        .map_err(|e| Error::from_io(&e, format!("{}/{}", f.export, f.path)))
                })?;
                Ok(Response::Ok)
            })
            .await
        }
        Request::Fsync { handle, data_only } => {
            let f = state.open_files.get(handle, session)?;
            blocking(move || {
                let r = if data_only {
                    f.fd()?.sync_data()
                } else {
                    f.fd()?.sync_all()
                };
                r.map_err(|e| Error::from_io(&e, format!("{}/{}", f.export, f.path)))?;
                Ok(Response::Ok)
            })
            .await
        }
        Request::ListDirX {
            export,
            path,
            cookie,
        } => {
            check(state, who, &export, READ)?;
            let (ex, ids) = export_as(&export)?;
            let budget = (state.limits.max_frame as usize).saturating_sub(64);
            blocking_as(ids, move || {
                let all = ex.list_x(&path)?;
                let (page, next_cookie) = page(&all, cookie, budget, |e| dir_entry_x_len(&e.0));
                Ok(Response::DirPageX {
                    entries: page.to_vec(),
                    next_cookie,
                })
            })
            .await
        }
        Request::StatX {
            export,
            path,
            follow,
        } => {
            check(state, who, &export, READ)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || Ok(Response::AttrX(ex.statx(&path, follow)?))).await
        }
        Request::StatHandle { handle } => {
            let f = state.open_files.get(handle, session)?;
            blocking(move || {
                let what = format!("{}/{}", f.export, f.path);
                Ok(Response::AttrX(crate::fs::statx_fd(
                    f.fd()?.as_raw_fd(),
                    &what,
                )?))
            })
            .await
        }
        Request::SetAttr { export, path, set } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking(move || {
                let r = as_caller(ids.as_ref(), || ex.set_attr(&path, &set));
                let a = match r {
                    // A writer's kernel clears the set-id bits of the file
                    // it writes by a chmod as the writer; the local kernel
                    // lets any writer do that much.
                    Err(e) if e.code == ErrorCode::NotPermitted && ids.is_some() => {
                        if as_caller(ids.as_ref(), || ex.only_kills_privileges(&path, &set))? {
                            ex.set_attr(&path, &set)?
                        } else {
                            return Err(e);
                        }
                    }
                    r => r?,
                };
                Ok(Response::AttrX(a))
            })
            .await
        }
        Request::SetAttrHandle { handle, set } => {
            let f = state.open_files.get(handle, session)?;
            if !set.is_empty() {
                check(state, who, &f.export, WRITE)?;
                if state.exports().get(&f.export)?.read_only {
                    return Err(Error::new(
                        ErrorCode::ReadOnly,
                        format!("export {} is read-only", f.export),
                    ));
                }
            }
            if set.size.is_some() && !f.rights.write {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "set-size needs a file opened for writing",
                ));
            }
            let (_, ids) = export_as(&f.export)?;
            blocking(move || {
                let what = format!("{}/{}", f.export, f.path);
                // The descriptor first, as the server (a reopen may need
                // its rights), then the change as the caller.
                let fd = f.fd()?;
                let a = as_caller(ids.as_ref(), || {
                    crate::fs::set_attr_fd(fd.as_raw_fd(), &set, &what)
                })?;
                Ok(Response::AttrX(a))
            })
            .await
        }
        Request::Lock {
            handle,
            owner,
            kind,
            start,
            len,
            test,
        } => {
            let f = state.open_files.get(handle, session)?;
            blocking(move || {
                Ok(
                    match crate::fs::lock_file(&f, owner, kind, start, len, test)? {
                        Some((kind, start, len)) => Response::LockInfo { kind, start, len },
                        None if test => Response::LockInfo {
                            kind: 0,
                            start: 0,
                            len: 0,
                        },
                        None => Response::Ok,
                    },
                )
            })
            .await
        }
        Request::CopyRange {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        } => {
            let s = state.open_files.get(src, session)?;
            let d = state.open_files.get(dst, session)?;
            if !s.rights.read || !d.rights.write {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "copy-range needs a source opened for reading and a destination opened for writing",
                ));
            }
            blocking(move || {
                let what = format!("{}/{} -> {}/{}", s.export, s.path, d.export, d.path);
                Ok(Response::Copied(crate::fs::copy_range_fd(
                    s.fd()?.as_raw_fd(),
                    src_offset,
                    d.fd()?.as_raw_fd(),
                    dst_offset,
                    len,
                    &what,
                )?))
            })
            .await
        }
        Request::Link { export, from, to } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || Ok(Response::AttrX(ex.link(&from, &to)?))).await
        }
        Request::Fallocate {
            handle,
            mode,
            offset,
            len,
        } => {
            let f = state.open_files.get(handle, session)?;
            if !f.rights.write {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "fallocate needs a file opened for writing",
                ));
            }
            blocking(move || {
                let what = format!("{}/{}", f.export, f.path);
                crate::fs::fallocate_fd(f.fd()?.as_raw_fd(), mode, offset, len, &what)?;
                Ok(Response::Ok)
            })
            .await
        }
        Request::Seek {
            handle,
            offset,
            whence,
        } => {
            let f = state.open_files.get(handle, session)?;
            blocking(move || {
                let what = format!("{}/{}", f.export, f.path);
                let w = if whence == SEEK_DATA {
                    libc::SEEK_DATA
                } else {
                    libc::SEEK_HOLE
                };
                Ok(Response::Offset(crate::fs::seek_fd(
                    f.fd()?.as_raw_fd(),
                    offset,
                    w,
                    &what,
                )?))
            })
            .await
        }
        Request::Symlink {
            export,
            path,
            target,
        } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                Ok(Response::AttrX(ex.symlink(&path, &target)?))
            })
            .await
        }
        Request::Readlink { export, path } => {
            check(state, who, &export, READ)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || Ok(Response::Target(ex.readlink(&path)?))).await
        }
        // Any logged-in session but an anonymous one: aggregate counters,
        // no names or paths (docs/metrics.md).
        Request::Stats if *who == Principal::Anonymous => Err(Error::new(
            ErrorCode::PermissionDenied,
            "anonymous sessions may not read the server's statistics: log in",
        )),
        Request::Stats => Ok(Response::Metrics(crate::metrics::render(state))),
        Request::Statfs { export } => {
            check(state, who, &export, READ)?;
            let ex = state.exports().get(&export)?.clone();
            blocking(move || Ok(Response::StatFs(ex.statfs()?))).await
        }
        Request::Remove2 { export, path, kind } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                ex.remove_kind(&path, kind).map(|_| Response::Ok)
            })
            .await
        }
        Request::Rename2 {
            export,
            from,
            to,
            flags,
        } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                ex.rename_flags(&from, &to, flags).map(|_| Response::Ok)
            })
            .await
        }
        Request::Mknod {
            export,
            path,
            mode,
            rdev,
        } => {
            check(state, who, &export, WRITE)?;
            let (ex, ids) = export_as(&export)?;
            blocking_as(ids, move || {
                Ok(Response::AttrX(ex.mknod(&path, mode, rdev)?))
            })
            .await
        }
        Request::FsyncDir { export, path } => {
            // As the server: a sync reveals and changes nothing.
            check(state, who, &export, READ)?;
            let ex = state.exports().get(&export)?.clone();
            blocking(move || ex.fsync_dir(&path).map(|_| Response::Ok)).await
        }
        Request::LeaseDir { export, path, want } => {
            check(state, who, &export, READ)?;
            let key = leases::dir_key(&export, &path)?;
            // Watched before it is granted: a change made on the server's
            // own file system after the grant breaks it (dirwatch.rs).
            if let Some(w) = &state.dir_watch {
                if let Ok(fd) = state.exports().get(&export)?.open_dir(&key.1) {
                    w.watch(std::os::fd::AsFd::as_fd(&fd), &key, &state.leases);
                }
            }
            let (lease_id, granted) = state.leases.grant(session, key.clone(), want, || {
                state.open_files.writers_in(&key.0, &key.1, session)
            });
            if lease_id != 0 {
                debug!(session, %export, dir = %key.1, lease_id, "lease granted");
            }
            Ok(Response::LeaseGranted { lease_id, granted })
        }
        Request::ReleaseLease { lease_id } => {
            state.leases.release(session, lease_id)?;
            Ok(Response::Ok)
        }
        Request::Resume { session_id, mac } => {
            let files = state.resume(session, who, session_id, &mac)?;
            Ok(Response::Resumed {
                files: files as u64,
            })
        }
        Request::Rekey { handle } => rekey(state, session, handle).await,
        Request::WatchBreaks { .. } | Request::LeaseBreakAck { .. } => Err(Error::new(
            ErrorCode::BadRequest,
            "not a watching connection",
        )),
        Request::Negotiate { request } => {
            let req = negotiate::decode_request(&request)?;
            let info = state
                .session(session)
                .ok_or_else(|| Error::new(ErrorCode::NotLoggedIn, "session ended"))?;
            let key = negotiate::random_guid();
            let (resp, bytes) =
                negotiate::build_response(&req, &state.server_name, key, &state.rdma_endpoints())?;
            state.add_negotiation(NegotiatedClient {
                key,
                session,
                session_secret: info.secret,
                client_name: req.client_name.clone(),
                client_key: req.key,
                offered: lwio_proto::transport::from_blocks(&resp.providers),
                expires: Instant::now() + state.limits.resume_key_ttl,
            });
            info!(
                session,
                client = %req.client_name,
                client_uuid = %req.key,
                offered = %lwio_proto::transport::describe(&lwio_proto::transport::from_blocks(&req.providers), false),
                common = resp.providers.len(),
                "negotiate"
            );
            Ok(Response::Negotiated { response: bytes })
        }
    }
}
