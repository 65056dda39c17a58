//! The side channel's part of memory objects (docs/memory-objects.md):
//! Publish and Unpublish, and the requests that name a path in the reserved
//! directory `EXPORT/.lwio-mem` (stat, list, open; everything that would
//! change it is refused).

use lwio_side::codec::*;
use lwio_side::error::{Error, ErrorCode};
use tracing::debug;

use super::{check, page, Principal, READ, WRITE};
use crate::fs::table::Rights;
use crate::memobj::{classify, PublishReq, Reserved, MEM_DIR};
use crate::state::ServerState;

fn reserved(export: &str) -> Error {
    Error::new(
        ErrorCode::PermissionDenied,
        format!("{export}/{MEM_DIR} is reserved for memory objects"),
    )
}

/// A read-only export takes no Publish and opens no object for writing,
/// whatever its access lists say (as its files).
fn writable(state: &ServerState, export: &str) -> Result<(), Error> {
    if state.exports().get(export)?.read_only {
        return Err(Error::new(
            ErrorCode::ReadOnly,
            format!("export {export} is read-only"),
        ));
    }
    Ok(())
}

fn no_such(export: &str, path: &str) -> Error {
    Error::new(
        ErrorCode::NotFound,
        format!("{export}/{path}: no such memory object"),
    )
}

/// Answer `req` here if it is about memory objects; `None` = not ours.
pub(super) fn intercept(
    state: &ServerState,
    session: u64,
    who: &Principal,
    req: &Request,
) -> Option<Result<Response, Error>> {
    let objs = &state.mem_objects;
    match req {
        Request::Publish {
            export,
            name,
            size,
            addr,
            rkey,
            rights,
            channel_key,
        } => Some((|| {
            // Publishing makes a name in the export: write access.
            check(state, who, export, WRITE)?;
            writable(state, export)?;
            let channel = lwio_proto::wire::Guid::from_bytes(channel_key)
                .ok_or_else(|| Error::new(ErrorCode::BadRequest, "channel key"))?;
            let o = objs.publish(
                session,
                PublishReq {
                    export: export.clone(),
                    name: name.clone(),
                    size: *size,
                    addr: *addr,
                    rkey: *rkey,
                    writable: rights & MEM_WRITE != 0,
                    channel,
                },
            )?;
            Ok(Response::Published { path: o.path() })
        })()),
        Request::Stat { export, path } => match classify(path) {
            Reserved::No => None,
            r => Some((|| {
                check(state, who, export, READ)?;
                match r {
                    Reserved::Dir => {
                        let a = crate::memobj::dir_attrx();
                        Ok(Response::Attr(lwio_side::types::Attr {
                            kind: a.kind,
                            perm: a.perm,
                            size: 0,
                            mtime_ns: 0,
                        }))
                    }
                    Reserved::Object(n) => Ok(Response::Attr(objs.get(export, n)?.attr())),
                    _ => Err(no_such(export, path)),
                }
            })()),
        },
        Request::StatX { export, path, .. } => match classify(path) {
            Reserved::No => None,
            r => Some((|| {
                check(state, who, export, READ)?;
                match r {
                    Reserved::Dir => Ok(Response::AttrX(crate::memobj::dir_attrx())),
                    Reserved::Object(n) => Ok(Response::AttrX(objs.get(export, n)?.attrx())),
                    _ => Err(no_such(export, path)),
                }
            })()),
        },
        Request::ListDir {
            export,
            path,
            cookie,
        } => match classify(path) {
            Reserved::No => None,
            r => Some(
                listing(state, who, export, path, &r, *cookie, |o| WireDirEntry {
                    name: o.spec.name.clone(),
                    attr: o.attr(),
                })
                .map(|(entries, next_cookie)| Response::DirPage {
                    entries,
                    next_cookie,
                }),
            ),
        },
        Request::ListDirX {
            export,
            path,
            cookie,
        } => match classify(path) {
            Reserved::No => None,
            r => Some(
                listing(state, who, export, path, &r, *cookie, |o| {
                    (o.spec.name.clone(), o.attrx())
                })
                .map(|(entries, next_cookie)| Response::DirPageX {
                    entries,
                    next_cookie,
                }),
            ),
        },
        Request::Open {
            export,
            path,
            access,
            flags,
            ..
        } => match classify(path) {
            Reserved::No => None,
            r => Some(open(state, session, who, export, path, &r, *access, *flags)),
        },
        // Nothing changes the reserved directory but Publish/Unpublish.
        Request::Remove { export, path }
        | Request::Remove2 { export, path, .. }
        | Request::Mkdir { export, path, .. }
        | Request::SetAttr { export, path, .. }
        | Request::Symlink { export, path, .. }
        | Request::Readlink { export, path }
        | Request::LeaseDir { export, path, .. }
            if classify(path) != Reserved::No =>
        {
            Some(Err(reserved(export)))
        }
        Request::Rename {
            export, from, to, ..
        }
        | Request::Rename2 {
            export, from, to, ..
        }
        | Request::Link { export, from, to }
            if classify(from) != Reserved::No || classify(to) != Reserved::No =>
        {
            Some(Err(reserved(export)))
        }
        // The stand-in file holds no data: the server copies no object.
        Request::CopyRange { src, dst, .. } => {
            let is_mem = |h: &u64| {
                state
                    .open_files
                    .get(*h, session)
                    .is_ok_and(|f| f.mem.is_some())
            };
            (is_mem(src) || is_mem(dst)).then(|| {
                Err(Error::new(
                    ErrorCode::Unsupported,
                    "copy-range does not copy memory objects: read and write them",
                ))
            })
        }
        _ => None,
    }
}

/// Wait (bounded) until no RDMA operation on a withdrawn object's key is in
/// flight: new ones are no longer posted, and those posted complete within
/// a round trip (or fail with the connection).
pub(super) async fn quiesce(o: &crate::memobj::MemObj) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while o.inflight() > 0 && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// A page of the reserved directory's listing (entries made by `entry`)
/// and the next cookie.
fn listing<T: Clone + DirLen>(
    state: &ServerState,
    who: &Principal,
    export: &str,
    path: &str,
    r: &Reserved<'_>,
    cookie: u64,
    entry: impl Fn(&crate::memobj::MemObj) -> T,
) -> Result<(Vec<T>, u64), Error> {
    check(state, who, export, READ)?;
    match r {
        Reserved::Dir => {}
        Reserved::Object(_) => {
            return Err(Error::new(
                ErrorCode::NotADirectory,
                format!("{export}/{path}: a memory object, not a directory"),
            ))
        }
        _ => return Err(no_such(export, path)),
    }
    let all: Vec<T> = state
        .mem_objects
        .list(export)
        .iter()
        .map(|o| entry(o))
        .collect();
    let budget = (state.limits.max_frame as usize).saturating_sub(64);
    let (p, next) = page(&all, cookie, budget, T::wire_len);
    Ok((p.to_vec(), next))
}

/// The wire size of a listing entry (for paging).
trait DirLen {
    fn wire_len(&self) -> usize;
}

impl DirLen for WireDirEntry {
    fn wire_len(&self) -> usize {
        dir_entry_len(self)
    }
}

impl DirLen for (String, lwio_side::types::AttrX) {
    fn wire_len(&self) -> usize {
        dir_entry_x_len(&self.0)
    }
}

#[allow(clippy::too_many_arguments)]
fn open(
    state: &ServerState,
    session: u64,
    who: &Principal,
    export: &str,
    path: &str,
    r: &Reserved<'_>,
    access: u32,
    flags: u32,
) -> Result<Response, Error> {
    let read = access & ACCESS_READ != 0;
    let write = access & ACCESS_WRITE != 0;
    if !read && !write {
        return Err(Error::new(
            ErrorCode::BadRequest,
            "open needs read or write access",
        ));
    }
    check(state, who, export, Rights { read, write })?;
    if write {
        writable(state, export)?;
    }
    let name = match r {
        Reserved::Object(n) => *n,
        Reserved::Dir => {
            return Err(Error::new(
                ErrorCode::IsADirectory,
                format!("{export}/{path}: a directory"),
            ))
        }
        _ => return Err(no_such(export, path)),
    };
    // Objects are made by Publish, never by an open.
    let obj = state.mem_objects.get(export, name)?;
    if flags & OPEN_CREATE != 0 && flags & OPEN_EXCLUSIVE != 0 {
        return Err(Error::new(
            ErrorCode::Exists,
            format!("{export}/{path}: exists"),
        ));
    }
    if write && !obj.spec.writable {
        return Err(Error::new(
            ErrorCode::PermissionDenied,
            format!("{export}/{path}: published read-only"),
        ));
    }
    // TRUNCATE is ignored (a memory object has a fixed size, as a device
    // file ignores O_TRUNC); NO_BUFFERING and WRITE_THROUGH change nothing
    // for memory.
    let opened = crate::memobj::opened(&obj)?;
    let size = opened.size;
    let (file, rk) =
        state
            .open_files
            .insert(session, opened, Rights { read, write }, export, path, None)?;
    debug!(session, %export, %path, handle = file.handle, "open memory object");
    Ok(Response::Opened {
        handle: file.handle,
        size,
        align: 1,
        resume_key: crate::fs::table::encode_request_resume_key(&rk),
        // A memory object is named, not stored: no identity across restarts.
        file_id: 0,
    })
}
