//! liblwio: the lwio client for programs in any language (C ABI).
//!
//! The header, `include/lwio.h`, is generated from this file by cbindgen
//! (`cargo test -p lwio-capi` fails when the checked-in copy is stale).
//! docs/capi.md describes the API; the C programs in `tests/c/` exercise it.
//!
//! Conventions: functions return `>= 0` on success and a negative errno on
//! failure (`lwio_connect` returns NULL); `lwio_errmsg()` gives the last
//! failure's message on the calling thread. Every pointer is checked for
//! NULL and every length for overflow, a file descriptor used after close
//! is `-EBADF`, and a panic never crosses the boundary: it is caught and
//! reported as `-EIO` with its message.

#![allow(clippy::missing_safety_doc, non_camel_case_types)]

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use lwio_client::side_client::SideOptions;
use lwio_client::{
    errno, Batch, Client, ClientOptions, Completion, ConnectArgs, Connection, End, File,
    OpenOptions, RegisteredBuf, Short, BOUNCE_THRESHOLD,
};
use lwio_proto::status::{NtStatus, STATUS_END_OF_FILE};

/// STATUS_CONNECTION_DISCONNECTED: a part whose completion never came
/// (the connection was lost); reported as EIO.
const LOST: NtStatus = 0xC000_020C;

/// Completion modes (`lwio_options.completion`).
pub const LWIO_COMPLETION_INTERRUPT: c_int = 0;
pub const LWIO_COMPLETION_POLL: c_int = 1;
/// Batch opcodes (`lwio_op.opcode`).
pub const LWIO_OP_READ: c_uint = 0;
pub const LWIO_OP_WRITE: c_uint = 1;

/// How to connect. Initialise with `lwio_options_init`, then set fields;
/// NULL strings mean "not given".
#[repr(C)]
pub struct lwio_options {
    /// The export's shared token, or NULL (with no token_file either:
    /// LWIO_TOKEN, else the default token file, else anonymous, as the
    /// lwio CLI).
    pub token: *const c_char,
    /// A file holding the token (read once), or NULL.
    pub token_file: *const c_char,
    /// Pin the server's TLS certificate: "sha256:AB:CD:…", or NULL
    /// (LWIO_FINGERPRINT if set).
    pub fingerprint: *const c_char,
    /// Trust on first use in this known_hosts file (NULL: LWIO_KNOWN_HOSTS,
    /// else ~/.config/lwio/known_hosts), unless `fingerprint` is given.
    pub known_hosts: *const c_char,
    /// Non-zero: plain TCP side channel (a server with `tls = false`).
    pub no_tls: c_int,
    /// LWIO_COMPLETION_INTERRUPT (default) or LWIO_COMPLETION_POLL.
    pub completion: c_int,
    /// "soft", "verbs" or NULL (auto).
    pub provider: *const c_char,
    /// Connect timeout in milliseconds (0: 5000).
    pub connect_timeout_ms: c_uint,
    /// Per-operation timeout in milliseconds (0: 30000).
    pub op_timeout_ms: c_uint,
    /// Requests in flight on the connection (0: 64; the server may grant
    /// fewer).
    pub credits: c_uint,
}

/// A connected client (opaque; `lwio_client` in C).
pub struct LwioClient {
    id: u64,
    client: Client,
    /// Submitted batch operations, oldest first.
    queue: Mutex<VecDeque<Pending>>,
    /// The eventfd of `lwio_completion_fd`, once asked for.
    notify: Mutex<Option<Arc<std::os::fd::OwnedFd>>>,
}

/// `lwio_fstat`'s answer.
#[repr(C)]
pub struct lwio_stat {
    pub size: u64,
    /// Permission bits (mode & 07777).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub ino: u64,
    /// 512-byte blocks.
    pub blocks: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

/// One batch operation (io_uring's SQE, in short).
#[repr(C)]
pub struct lwio_op {
    /// Returned in the completion.
    pub user_data: u64,
    pub fd: c_int,
    /// LWIO_OP_READ or LWIO_OP_WRITE.
    pub opcode: c_uint,
    /// Must stay valid (and, for a read, untouched) until reaped.
    pub buf: *mut c_void,
    pub len: u64,
    pub offset: u64,
}

/// One completion: `res` is the byte count (a read short of `len` ended at
/// the end of the file) or a negative errno.
#[repr(C)]
pub struct lwio_cqe {
    pub user_data: u64,
    pub res: i64,
}

/// An iovec, as `struct iovec` (`<sys/uio.h>`) lays it out.
#[repr(C)]
pub struct lwio_iovec {
    pub iov_base: *mut c_void,
    pub iov_len: usize,
}

// ---------------------------------------------------------------- state

struct OpenFile {
    client_id: u64,
    file: File,
}

#[derive(Default)]
struct Tables {
    /// fd → open file (an fd is an index; freed ones are reused lowest
    /// first, as the kernel does).
    files: Vec<Option<Arc<OpenFile>>>,
    /// Live clients (by address), so a stale pointer is refused.
    clients: HashSet<usize>,
    /// Registered buffers by address.
    /// `lwio_buf_alloc` buffers by start address (ordered: `lwio_pread`
    /// finds the one holding an address).
    bufs: BTreeMap<usize, RegisteredBuf>,
    /// Published buffers (`lwio_publish`) by object id.
    pubs: HashMap<i64, Publication>,
    next_pub: i64,
}

/// A buffer of `lwio_buf_alloc` while published: the `Published` owns it
/// until `lwio_unpublish` puts it back in `bufs`.
struct Publication {
    client_id: u64,
    addr: usize,
    published: lwio_client::Published,
}

fn tables() -> MutexGuard<'static, Tables> {
    static T: OnceLock<Mutex<Tables>> = OnceLock::new();
    T.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `msg` as this thread's last error; returns `-errno`.
fn fail(errno: c_int, msg: impl Into<String>) -> c_int {
    let m = msg.into().replace('\0', " ");
    LAST.with(|l| *l.borrow_mut() = CString::new(m).unwrap_or_default());
    -errno
}

fn fail_client(e: &lwio_client::Error) -> c_int {
    fail(errno::client(e), e.to_string())
}

/// Run `f`, turning a panic into -EIO with its message.
fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            fail(libc::EIO, format!("internal error (panic): {msg}"));
            on_panic
        }
    }
}

/// A C string argument as `&str` (`None` for NULL; EINVAL if not UTF-8).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and
/// unchanged for `'a` (every `const char *` of the API is such a string for
/// the duration of the call it is passed to).
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, c_int> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string (the API's
    // contract for every `const char *`), alive for this call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map(Some)
        .map_err(|_| fail(libc::EINVAL, format!("{what} is not UTF-8")))
}

fn file(fd: c_int) -> Result<Arc<OpenFile>, c_int> {
    usize::try_from(fd)
        .ok()
        .and_then(|i| tables().files.get(i).cloned().flatten())
        .ok_or_else(|| fail(libc::EBADF, format!("fd {fd} is not an open lwio file")))
}

fn client_ref<'a>(c: *const LwioClient) -> Result<&'a LwioClient, c_int> {
    if c.is_null() || !tables().clients.contains(&(c as usize)) {
        return Err(fail(libc::EBADF, "not a connected lwio client"));
    }
    // SAFETY: the address is in the live set: it came from Box::into_raw in
    // lwio_connect and lwio_disconnect has not freed it yet (it removes it
    // from the set first). A caller racing a disconnect with other calls
    // on the same client breaks the API's contract, as with free(3).
    Ok(unsafe { &*c })
}

// ---------------------------------------------------------------- API

/// The message of the calling thread's last failure ("" if none). Valid
/// until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn lwio_errmsg() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// Fill `opts` with the defaults (every string NULL, interrupt completions,
/// TLS with trust on first use).
#[no_mangle]
pub unsafe extern "C" fn lwio_options_init(opts: *mut lwio_options) {
    if opts.is_null() {
        return;
    }
    // SAFETY: non-null, and the caller passes a writable lwio_options.
    unsafe {
        opts.write(lwio_options {
            token: std::ptr::null(),
            token_file: std::ptr::null(),
            fingerprint: std::ptr::null(),
            known_hosts: std::ptr::null(),
            no_tls: 0,
            completion: LWIO_COMPLETION_INTERRUPT,
            provider: std::ptr::null(),
            connect_timeout_ms: 0,
            op_timeout_ms: 0,
            credits: 0,
        })
    };
}

/// `lwio_connect`'s work.
///
/// # Safety
/// `url` is NULL or a NUL-terminated string; `o` is NULL or points to an
/// initialised `lwio_options` whose string fields are each NULL or a
/// NUL-terminated string; all valid for the call (`lwio_connect`'s
/// contract).
unsafe fn connect_inner(url: *const c_char, o: *const lwio_options) -> Result<LwioClient, c_int> {
    // SAFETY: `url` is NULL or a C string valid for this call (contract).
    let url = unsafe { opt_str(url, "url") }?.ok_or_else(|| fail(libc::EINVAL, "url is NULL"))?;
    let mut d = std::mem::MaybeUninit::<lwio_options>::uninit();
    let o: &lwio_options = if o.is_null() {
        // SAFETY: lwio_options_init writes every field.
        unsafe {
            lwio_options_init(d.as_mut_ptr());
            d.assume_init_ref()
        }
    } else {
        // SAFETY: non-null, the caller's initialised options.
        unsafe { &*o }
    };
    // The one client default (lwio_client::connect): what the options
    // leave out comes from LWIO_TOKEN, the default token file, known_hosts
    // (trust on first use), as for the `lwio` CLI.
    // SAFETY (this and the other `opt_str` calls on `o`'s fields): each
    // string field of the options is NULL or a C string valid for this call
    // (contract), and `lwio_options_init` sets them all to NULL; the `&str`
    // is used only within the call.
    let fingerprint = unsafe { opt_str(o.fingerprint, "fingerprint") }?;
    if let Some(fp) = fingerprint {
        lwio_side::tls::parse_fingerprint(fp)
            .map_err(|e| fail(libc::EINVAL, format!("fingerprint: {e}")))?;
    }
    let args = ConnectArgs {
        // SAFETY: as for `o.fingerprint`.
        token: unsafe { opt_str(o.token, "token") }?.map(|t| t.trim().to_string()),
        // SAFETY: as for `o.fingerprint`.
        token_file: unsafe { opt_str(o.token_file, "token_file") }?.map(Into::into),
        no_tls: o.no_tls != 0,
        fingerprint: fingerprint.map(Into::into),
        // SAFETY: as for `o.fingerprint`.
        known_hosts: unsafe { opt_str(o.known_hosts, "known_hosts") }?.map(Into::into),
        connect_timeout: (o.connect_timeout_ms > 0)
            .then(|| Duration::from_millis(o.connect_timeout_ms.into())),
        ..ConnectArgs::default()
    };
    let mut so = SideOptions::resolve(&args).map_err(|e| {
        let errno = match e.code {
            lwio_side::ErrorCode::NotFound | lwio_side::ErrorCode::PermissionDenied => libc::EACCES,
            _ => libc::EINVAL,
        };
        fail(errno, e.to_string())
    })?;
    so.client_name = "liblwio".into();
    let mut opts = ClientOptions {
        completion: if o.completion == LWIO_COMPLETION_POLL {
            Completion::Poll
        } else {
            Completion::Interrupt
        },
        client_name: "liblwio".into(),
        connect_timeout: so.connect_timeout,
        ..ClientOptions::default()
    };
    opts.credits = match o.credits {
        0 => 64,
        n => u16::try_from(n).map_err(|_| fail(libc::EINVAL, "credits: at most 65535"))?,
    };
    if o.op_timeout_ms > 0 {
        opts.op_timeout = Duration::from_millis(o.op_timeout_ms.into());
    }
    // SAFETY: as for `o.token`.
    if let Some(p) = unsafe { opt_str(o.provider, "provider") }? {
        opts.provider = p
            .parse()
            .map_err(|e| fail(libc::EINVAL, format!("provider {p:?}: {e}")))?;
    }
    let client = Client::connect_with(url, &so, opts).map_err(|e| fail_client(&e))?;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    Ok(LwioClient {
        id: NEXT.fetch_add(1, Ordering::Relaxed),
        client,
        queue: Mutex::new(VecDeque::new()),
        notify: Mutex::new(None),
    })
}

/// Connect and log in: `url` is `lwio://HOST[:PORT][/EXPORT]`; `opts` may
/// be NULL for the defaults. NULL on failure (see `lwio_errmsg`).
#[no_mangle]
pub unsafe extern "C" fn lwio_connect(
    url: *const c_char,
    opts: *const lwio_options,
) -> *mut LwioClient {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller's strings and options, per the API contract.
        match unsafe { connect_inner(url, opts) } {
            Ok(c) => {
                let p = Box::into_raw(Box::new(c));
                tables().clients.insert(p as usize);
                p
            }
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// Close every file of `c`, end its session and free it.
#[no_mangle]
pub unsafe extern "C" fn lwio_disconnect(c: *mut LwioClient) -> c_int {
    guard(-libc::EIO, || {
        let mut unpublished = Vec::new();
        let files: Vec<Arc<OpenFile>> = {
            let mut t = tables();
            if c.is_null() || !t.clients.remove(&(c as usize)) {
                return fail(libc::EBADF, "not a connected lwio client");
            }
            // SAFETY: it was live (just removed from the set, so no other
            // call will take it from now on).
            let id = unsafe { (*c).id };
            // Its publications go first (each holds the client).
            let ids: Vec<i64> = t
                .pubs
                .iter()
                .filter(|(_, p)| p.client_id == id)
                .map(|(k, _)| *k)
                .collect();
            for k in ids {
                if let Some(p) = t.pubs.remove(&k) {
                    unpublished.push(p);
                }
            }
            t.files
                .iter_mut()
                .filter(|f| f.as_ref().is_some_and(|f| f.client_id == id))
                .filter_map(Option::take)
                .collect()
        };
        drop(files);
        // Unpublish outside the table lock (a side-channel round trip); the
        // buffers go back to the table, still the program's to free.
        for p in unpublished {
            if let Ok(b) = p.published.unpublish() {
                tables().bufs.insert(p.addr, b);
            }
        }
        // SAFETY: from Box::into_raw in lwio_connect, freed once (the set
        // membership above was the token).
        let c = unsafe { Box::from_raw(c) };
        c.client.set_completion_notify(None);
        drop(c);
        0
    })
}

/// Open `path` (`EXPORT/PATH`, or `PATH` when the URL named the export)
/// with open(2) flags (O_RDONLY, O_WRONLY, O_RDWR, O_CREAT, O_EXCL,
/// O_TRUNC, O_DIRECT, O_SYNC, O_DSYNC) and, when creating, `mode`. A file
/// descriptor of this library (not the kernel's) or -errno.
#[no_mangle]
pub unsafe extern "C" fn lwio_open(
    c: *const LwioClient,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    guard(-libc::EIO, || {
        let r = (|| -> Result<c_int, c_int> {
            let c = client_ref(c)?;
            // SAFETY: the caller's NUL-terminated path.
            let path = unsafe { opt_str(path, "path") }?
                .ok_or_else(|| fail(libc::EFAULT, "path is NULL"))?;
            let acc = flags & libc::O_ACCMODE;
            let mut o = OpenOptions::read_only();
            o.0.read = acc != libc::O_WRONLY;
            o.0.write = acc != libc::O_RDONLY;
            o.0.create = flags & libc::O_CREAT != 0;
            o.0.exclusive = flags & libc::O_EXCL != 0;
            o.0.truncate = flags & libc::O_TRUNC != 0;
            o.0.no_buffering = flags & libc::O_DIRECT != 0;
            o.0.set_sync_flags(flags);
            if acc == libc::O_ACCMODE {
                return Err(fail(libc::EINVAL, "flags: no access mode"));
            }
            let f = c
                .client
                .open_mode(path, &o, mode & 0o7777)
                .map_err(|e| fail_client(&e))?;
            let entry = Arc::new(OpenFile {
                client_id: c.id,
                file: f,
            });
            let mut t = tables();
            let i = match t.files.iter().position(Option::is_none) {
                Some(i) => i,
                None => {
                    t.files.push(None);
                    t.files.len() - 1
                }
            };
            let fd = c_int::try_from(i).map_err(|_| fail(libc::EMFILE, "too many open files"))?;
            t.files[i] = Some(entry);
            Ok(fd)
        })();
        r.unwrap_or_else(|e| e)
    })
}

/// Close `fd` (its operations still in a batch complete first: the file
/// closes when the last of them is reaped).
#[no_mangle]
pub extern "C" fn lwio_close(fd: c_int) -> c_int {
    guard(-libc::EIO, || {
        let f = usize::try_from(fd)
            .ok()
            .and_then(|i| tables().files.get_mut(i).and_then(Option::take));
        let Some(f) = f else {
            return fail(libc::EBADF, format!("fd {fd} is not an open lwio file"));
        };
        match Arc::try_unwrap(f) {
            Ok(f) => f
                .file
                .close()
                .map(|()| 0)
                .unwrap_or_else(|e| fail_client(&e)),
            // A reaper or a concurrent call still holds it: it closes when
            // that one drops it.
            Err(_) => 0,
        }
    })
}

fn len_ok(len: usize, off: u64) -> Result<(), c_int> {
    if isize::try_from(len).is_err() || off.checked_add(len as u64).is_none() {
        return Err(fail(libc::EINVAL, "offset + length overflows"));
    }
    Ok(())
}

/// The checks every data call makes: the open file, or the result to
/// return at once (0 bytes for an empty call, or -errno).
fn data_call(fd: c_int, buf: *const c_void, len: usize, offset: u64) -> Result<Arc<OpenFile>, i64> {
    let f = file(fd).map_err(i64::from)?;
    if len == 0 {
        return Err(0);
    }
    if buf.is_null() {
        return Err(fail(libc::EFAULT, "buf is NULL").into());
    }
    len_ok(len, offset).map_err(i64::from)?;
    Ok(f)
}

/// Take the `lwio_buf_alloc` buffer holding all of `[p, p + len)` out of
/// the table, with its start and the range's offset in it; `lwio_pread`
/// puts it back.
fn take_buf(p: usize, len: usize) -> Option<(usize, usize, RegisteredBuf)> {
    let mut t = tables();
    let (&start, b) = t.bufs.range(..=p).next_back()?;
    let at = p - start;
    if at.checked_add(len)? > b.len() {
        return None;
    }
    t.bufs.remove(&start).map(|b| (start, at, b))
}

/// pread(2): bytes read (fewer at the end of the file, 0 at or past it).
#[no_mangle]
pub unsafe extern "C" fn lwio_pread(fd: c_int, buf: *mut c_void, len: usize, offset: u64) -> i64 {
    guard(-i64::from(libc::EIO), || {
        let f = match data_call(fd, buf, len, offset) {
            Ok(f) => f,
            Err(r) => return r,
        };
        // Into an `lwio_buf_alloc` buffer: `File::read_registered`, which
        // forms no Rust reference over the bytes the peer writes (through
        // the buffer's own pointer, as its cached registration does), and
        // lands in them directly; `read_at` into a slice of them would stage
        // or register for the call instead (it never uses the cached
        // registration behind a reference). The buffer is out of the table
        // meanwhile, so the `&mut` it needs is exclusive; a concurrent
        // `lwio_pread` into the same buffer takes the `read_at` path below,
        // and `lwio_buf_free` of a buffer being read fails with EINVAL.
        if let Some((start, at, mut rb)) = take_buf(buf as usize, len) {
            let r = f.file.read_registered(&mut rb, at..at + len, offset);
            tables().bufs.insert(start, rb);
            return match r {
                Ok(n) => n as i64,
                Err(e) => fail_client(&e).into(),
            };
        }
        // SAFETY: the caller lends `len` writable bytes at `buf` for the
        // call (pread's contract: nothing else reads or writes them until it
        // returns, docs/capi.md), so this is the only reference over them.
        // `read_at` keeps every remote window over them inside the call, and
        // the peer writes them only through a per-call registration of a
        // pointer derived from this slice (never an `lwio_buf_alloc`
        // buffer's cached registration: `File::read_impl` in lwio-client),
        // which Stacked and Tree Borrows allow while `b` is not used.
        let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
        match f.file.read_at(b, offset) {
            Ok(n) => n as i64,
            Err(e) => fail_client(&e).into(),
        }
    })
}

/// pwrite(2): bytes written (all of them, or -errno).
#[no_mangle]
pub unsafe extern "C" fn lwio_pwrite(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    offset: u64,
) -> i64 {
    guard(-i64::from(libc::EIO), || {
        let f = match data_call(fd, buf, len, offset) {
            Ok(f) => f,
            Err(r) => return r,
        };
        // SAFETY: the caller lends `len` readable bytes for the call.
        let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
        let mut done = 0usize;
        while done < len {
            match f.file.write_at(&b[done..], offset + done as u64) {
                Ok(0) => return fail(libc::EIO, "write made no progress").into(),
                Ok(n) => done += n,
                Err(e) => return fail_client(&e).into(),
            }
        }
        done as i64
    })
}

/// The caller's iovec array as a slice (validated: count, NULL bases).
///
/// # Safety
/// When `n > 0`, `iov` is NULL or points to `n` initialised `lwio_iovec`s
/// that stay valid and unchanged for `'a`.
unsafe fn iovecs<'a>(iov: *const lwio_iovec, n: c_int) -> Result<&'a [lwio_iovec], c_int> {
    let n = usize::try_from(n).map_err(|_| fail(libc::EINVAL, "iovcnt < 0"))?;
    if n > 1024 {
        return Err(fail(libc::EINVAL, "iovcnt > IOV_MAX (1024)"));
    }
    if n == 0 {
        return Ok(&[]);
    }
    if iov.is_null() {
        return Err(fail(libc::EFAULT, "iov is NULL"));
    }
    // SAFETY: non-null (checked), `n` (> 0, at most 1024) initialised
    // iovecs valid for `'a` (the contract above); `lwio_iovec` has no
    // invalid bit patterns to rule out.
    let v = unsafe { std::slice::from_raw_parts(iov, n) };
    if v.iter().any(|i| i.iov_base.is_null() && i.iov_len > 0) {
        return Err(fail(libc::EFAULT, "an iov_base is NULL"));
    }
    Ok(v)
}

/// Run `each` over the iovecs at consecutive offsets: the total, or the
/// first error if nothing was done; a read stops at a short piece.
///
/// # Safety
/// `iov` and `iovcnt` as `lwio_preadv`/`lwio_pwritev` take them: `iovcnt`
/// iovecs, each lending `iov_len` bytes at `iov_base` (writable for a
/// read) for the call, not touched by the caller meanwhile.
unsafe fn vectored(
    fd: c_int,
    iov: *const lwio_iovec,
    iovcnt: c_int,
    offset: u64,
    read: bool,
) -> i64 {
    // SAFETY: `iovcnt` iovecs valid for this call (the contract above);
    // the slice does not outlive it.
    let v = match unsafe { iovecs(iov, iovcnt) } {
        Ok(v) => v,
        Err(e) => return e.into(),
    };
    let mut total: i64 = 0;
    for i in v {
        let off = offset + total as u64;
        // SAFETY: each iovec lends `iov_len` bytes at `iov_base` for this
        // call (the contract above), which is what `lwio_pread` and
        // `lwio_pwrite` ask for `buf` and `len`.
        let n = unsafe {
            if read {
                lwio_pread(fd, i.iov_base, i.iov_len, off)
            } else {
                lwio_pwrite(fd, i.iov_base, i.iov_len, off)
            }
        };
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if read && (n as usize) < i.iov_len {
            break;
        }
    }
    total
}

/// preadv(2).
#[no_mangle]
pub unsafe extern "C" fn lwio_preadv(
    fd: c_int,
    iov: *const lwio_iovec,
    iovcnt: c_int,
    offset: u64,
) -> i64 {
    // SAFETY: the caller's iovecs, per preadv's contract.
    guard(-i64::from(libc::EIO), || unsafe {
        vectored(fd, iov, iovcnt, offset, true)
    })
}

/// pwritev(2).
#[no_mangle]
pub unsafe extern "C" fn lwio_pwritev(
    fd: c_int,
    iov: *const lwio_iovec,
    iovcnt: c_int,
    offset: u64,
) -> i64 {
    // SAFETY: the caller's iovecs, per pwritev's contract.
    guard(-i64::from(libc::EIO), || unsafe {
        vectored(fd, iov, iovcnt, offset, false)
    })
}

/// fsync(2), or fdatasync(2) when `datasync` is non-zero.
#[no_mangle]
pub extern "C" fn lwio_fsync(fd: c_int, datasync: c_int) -> c_int {
    guard(-libc::EIO, || match file(fd) {
        Ok(f) => {
            let r = if datasync != 0 {
                f.file.sync_data()
            } else {
                f.file.sync_all()
            };
            r.map(|()| 0).unwrap_or_else(|e| fail_client(&e))
        }
        Err(e) => e,
    })
}

/// ftruncate(2).
#[no_mangle]
pub extern "C" fn lwio_ftruncate(fd: c_int, size: u64) -> c_int {
    guard(-libc::EIO, || match file(fd) {
        Ok(f) => f
            .file
            .set_len(size)
            .map(|()| 0)
            .unwrap_or_else(|e| fail_client(&e)),
        Err(e) => e,
    })
}

/// fstat(2) of an open file, from the server.
#[no_mangle]
pub unsafe extern "C" fn lwio_fstat(fd: c_int, st: *mut lwio_stat) -> c_int {
    guard(-libc::EIO, || {
        let f = match file(fd) {
            Ok(f) => f,
            Err(e) => return e,
        };
        if st.is_null() {
            return fail(libc::EFAULT, "st is NULL");
        }
        match f.file.stat() {
            Ok(a) => {
                // SAFETY: non-null, the caller's writable lwio_stat.
                unsafe {
                    st.write(lwio_stat {
                        size: a.size,
                        mode: a.perm & 0o7777,
                        nlink: a.nlink,
                        uid: a.uid,
                        gid: a.gid,
                        ino: a.ino,
                        blocks: a.blocks,
                        atime_ns: a.atime_ns,
                        mtime_ns: a.mtime_ns,
                        ctime_ns: a.ctime_ns,
                    })
                };
                0
            }
            Err(e) => fail_client(&e),
        }
    })
}

/// Allocate `len` zeroed bytes registered with the client: reads of at
/// least 1 KiB into them land with no copy and no per-call registration.
/// NULL on failure. Free with `lwio_buf_free`.
#[no_mangle]
pub unsafe extern "C" fn lwio_buf_alloc(c: *const LwioClient, len: usize) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let c = match client_ref(c) {
            Ok(c) => c,
            Err(_) => return std::ptr::null_mut(),
        };
        if len == 0 || isize::try_from(len).is_err() {
            fail(libc::EINVAL, "length 0 or too large");
            return std::ptr::null_mut();
        }
        match c.client.register_buffer(len) {
            Ok(mut b) => {
                let p = b.as_mut_ptr();
                tables().bufs.insert(p as usize, b);
                p.cast()
            }
            Err(e) => {
                fail_client(&e);
                std::ptr::null_mut()
            }
        }
    })
}

/// Free a buffer of `lwio_buf_alloc` (-EINVAL for any other pointer).
#[no_mangle]
pub unsafe extern "C" fn lwio_buf_free(p: *mut c_void) -> c_int {
    guard(-libc::EIO, || {
        // One lock at a time: the table's mutex is not reentrant.
        let (b, published) = {
            let mut t = tables();
            let b = t.bufs.remove(&(p as usize));
            let published = t.pubs.values().any(|x| x.addr == p as usize);
            (b, published)
        };
        match b {
            Some(b) => {
                drop(b);
                0
            }
            None if published => fail(
                libc::EBUSY,
                "the buffer is published: lwio_unpublish it first",
            ),
            None => fail(libc::EINVAL, "not a buffer of lwio_buf_alloc"),
        }
    })
}

// ---------------------------------------------------------------- memory objects

/// `lwio_publish` flag: other clients may only read the object.
pub const LWIO_MEM_READ_ONLY: c_uint = 1;

/// Publish a whole buffer of `lwio_buf_alloc` as memory object `name`
/// (`NAME` when the URL named the export, else `EXPORT/NAME`): other
/// clients open `EXPORT/.lwio-mem/NAME` and read it, and write it unless
/// `flags` has `LWIO_MEM_READ_ONLY`, while the server moves the bytes with
/// RDMA (docs/memory-objects.md). The object's path is written to `path`
/// (`path_len` bytes with the NUL; may be NULL). Returns an object id
/// (≥ 1) or -errno. Until `lwio_unpublish`, the buffer may change at any
/// time under the program (remote writers), and `lwio_buf_free` of it
/// fails with -EBUSY. `lwio_disconnect` unpublishes the client's objects.
/// When it fails (the name taken, too many objects, ...) the buffer stays
/// the program's as it was: usable, and freed with `lwio_buf_free`.
#[no_mangle]
pub unsafe extern "C" fn lwio_publish(
    c: *const LwioClient,
    name: *const c_char,
    buf: *mut c_void,
    flags: c_uint,
    path: *mut c_char,
    path_len: usize,
) -> i64 {
    guard(-i64::from(libc::EIO), || {
        let r = (|| -> Result<i64, c_int> {
            let c = client_ref(c)?;
            // SAFETY: the caller's NUL-terminated string, per the API
            // contract.
            let name = unsafe { opt_str(name, "name") }?
                .ok_or_else(|| fail(libc::EINVAL, "name is NULL"))?;
            if flags & !LWIO_MEM_READ_ONLY != 0 {
                return Err(fail(libc::EINVAL, format!("unknown flags {flags:#x}")));
            }
            let rights = if flags & LWIO_MEM_READ_ONLY != 0 {
                lwio_client::MemRights::ReadOnly
            } else {
                lwio_client::MemRights::ReadWrite
            };
            let b = tables()
                .bufs
                .remove(&(buf as usize))
                .ok_or_else(|| fail(libc::EINVAL, "not a buffer of lwio_buf_alloc"))?;
            let published = match c.client.publish(name, b, rights) {
                Ok(p) => p,
                Err(e) => {
                    // Refused: the buffer is the program's again, as it
                    // was (freeing it here would leave the caller's
                    // pointer dangling).
                    tables().bufs.insert(buf as usize, e.buf);
                    return Err(fail_client(&e.error));
                }
            };
            let full = published.path().to_string();
            if !path.is_null() && path_len > 0 {
                let n = full.len().min(path_len - 1);
                // SAFETY: the caller gives `path_len` writable bytes at
                // `path`; n + 1 <= path_len.
                unsafe {
                    std::ptr::copy_nonoverlapping(full.as_ptr(), path.cast::<u8>(), n);
                    *path.add(n) = 0;
                }
            }
            let mut t = tables();
            t.next_pub += 1;
            let id = t.next_pub;
            t.pubs.insert(
                id,
                Publication {
                    client_id: c.id,
                    addr: buf as usize,
                    published,
                },
            );
            Ok(id)
        })();
        r.unwrap_or_else(i64::from)
    })
}

/// Withdraw an object of `lwio_publish`: its path is gone and no other
/// client reaches the buffer any more (it is the program's again, for
/// `lwio_buf_free` too). 0 or -errno.
#[no_mangle]
pub extern "C" fn lwio_unpublish(id: i64) -> c_int {
    guard(-libc::EIO, || {
        let Some(p) = tables().pubs.remove(&id) else {
            return fail(libc::EINVAL, format!("no memory object {id}"));
        };
        let addr = p.addr;
        match p.published.unpublish() {
            Ok(b) => {
                tables().bufs.insert(addr, b);
                0
            }
            Err(e) => fail_client(&e),
        }
    })
}

// ---------------------------------------------------------------- batch

struct Pending {
    user_data: u64,
    read: bool,
    buf: usize,
    /// The operation's requests (its parts), on its file's connection.
    batch: Batch,
    /// Keeps the file open until the operation is reaped; runs lost parts
    /// again.
    file: Arc<OpenFile>,
    /// The operation's file offset.
    offset: u64,
    /// A failure at issue time (no parts after it were issued).
    issue_error: Option<i64>,
}

impl Pending {
    /// Collect the parts' results (staging copies, releases) into a CQE.
    /// Every part is complete (`lwio_reap` waited for them).
    fn finish(mut self) -> lwio_cqe {
        // No window over the caller's memory outlives the operation.
        self.batch.fence();
        let mut replay_err = None;
        loop {
            let Some(l) = self.batch.reap() else { break };
            if l.lost() {
                // Lost with the connection: the blocking call runs it
                // again after the reconnect (and re-registers the file,
                // so later submissions use the new connection).
                let (at, len) = (l.at(), l.part_len());
                drop(l);
                let r = self.replay(at, len);
                if let Err(e) = &r {
                    replay_err = Some(-i64::from(errno::client(e)));
                }
                self.batch.replayed(len, r);
                continue;
            }
            // SAFETY: the caller lent `len` bytes at `buf` until this
            // operation is reaped (lwio_op's contract); this copy out of
            // staging is the only write to them (a part that landed in the
            // caller's memory, fenced above, has nothing to copy).
            unsafe { l.copy_into_raw(self.buf as *mut u8) };
        }
        let what = if self.read { "READ" } else { "WRITE" };
        let status = |status| {
            -i64::from(errno::client(&lwio_client::Error::Status {
                what: what.into(),
                status,
            }))
        };
        let (total, end) = self.batch.take_end();
        let err = match end {
            None | Some(End::Short) | Some(End::Status(STATUS_END_OF_FILE)) => None,
            Some(End::Status(st)) => Some(status(st)),
            // A replay's own error, else a part whose completion never
            // came (STATUS_CONNECTION_DISCONNECTED, EIO).
            Some(End::Failed(_)) => replay_err.or_else(|| Some(status(LOST))),
        };
        let total = total as i64;
        let res = match (err, self.issue_error) {
            (Some(e), _) if total == 0 => e,
            (_, Some(e)) if total == 0 => e,
            _ => total,
        };
        lwio_cqe {
            user_data: self.user_data,
            res,
        }
    }

    /// Run the part at `at` of `len` bytes again as a blocking read or
    /// write of the `File`. The ordering rule holds (docs/reconnect.md):
    /// the operation has not been reaped, so it is concurrent with those
    /// submitted meanwhile, and it completes only after its re-sent piece
    /// did.
    fn replay(&self, at: usize, len: usize) -> lwio_client::Result<usize> {
        let off = self.offset + at as u64;
        if self.read {
            // SAFETY: the caller lent `len` bytes at `buf` until this
            // operation is reaped (lwio_op's contract). No window over
            // them is bound any more (`finish` fenced the batch), so no
            // peer writes them; the read below is the only writer.
            let dst = unsafe { std::slice::from_raw_parts_mut((self.buf as *mut u8).add(at), len) };
            self.file.file.read_at(dst, off)
        } else {
            // SAFETY: the caller lent `len` readable bytes at `buf` until
            // this operation is reaped; nothing writes them meanwhile.
            let src = unsafe { std::slice::from_raw_parts((self.buf as *const u8).add(at), len) };
            self.file.file.write_at(src, off)
        }
    }
}

/// Why an operation was not submitted.
enum NotIssued {
    /// No room now (staging buffers are all held by reads not yet reaped).
    Full,
    Err(c_int),
}

fn issue(op: &lwio_op) -> Result<Pending, NotIssued> {
    issue_inner(op)
        .map_err(NotIssued::Err)?
        .ok_or(NotIssued::Full)
}

fn issue_inner(op: &lwio_op) -> Result<Option<Pending>, c_int> {
    let f = file(op.fd)?;
    if op.opcode != LWIO_OP_READ && op.opcode != LWIO_OP_WRITE {
        return Err(fail(libc::EINVAL, format!("opcode {}", op.opcode)));
    }
    let len = usize::try_from(op.len).map_err(|_| fail(libc::EINVAL, "len too large"))?;
    if len > 0 && op.buf.is_null() {
        return Err(fail(libc::EFAULT, "buf is NULL"));
    }
    len_ok(len, op.offset)?;
    let read = op.opcode == LWIO_OP_READ;
    let mut batch = f
        .file
        .batch(op.offset, if read { Short::Ends } else { Short::Counts });
    batch.replay_lost();
    let chunk = if read {
        batch.max_read()
    } else {
        batch.max_write()
    };
    let parts = len.div_ceil(chunk).max(1);
    // A read goes straight into the caller's memory when it lies in an
    // lwio_buf_alloc buffer or is long enough to register for the call;
    // else through staging buffers, which must all be free now.
    // SAFETY: the caller lends `len` bytes at `buf`, untouched until this
    // operation is reaped (lwio_op's contract), and the batch fences them
    // (`finish`, or its drop) before the completion is handed back.
    let direct =
        read && len >= BOUNCE_THRESHOLD && unsafe { batch.land_in_memory(op.buf.cast(), len) };
    if read && !direct && batch.free_stages(chunk.min(len)) < parts {
        return Ok(None);
    }
    let mut p = Pending {
        user_data: op.user_data,
        read,
        buf: op.buf as usize,
        batch,
        file: f.clone(),
        offset: op.offset,
        issue_error: None,
    };
    while p.batch.issued() < len {
        let at = p.batch.issued();
        let n = chunk.min(len - at);
        let r = if read {
            p.batch.read(n, None)
        } else {
            // SAFETY: the caller lends `len` readable bytes until reaped;
            // the engine copies them into its send slot here.
            let data = unsafe { std::slice::from_raw_parts((op.buf as *const u8).add(at), n) };
            p.batch.write(data)
        };
        match r {
            Ok(()) => {}
            Err(e @ lwio_client::Error::ConnectionLost(_)) => {
                // The rest runs again when reaped (after the reconnect).
                p.batch.lose_rest(len - at, e);
                break;
            }
            Err(err) => {
                let code = fail_client(&err);
                if p.batch.outstanding() == 0 {
                    // Dropping the batch fences the caller's memory.
                    return Err(code);
                }
                p.issue_error = Some(code.into());
                break;
            }
        }
    }
    Ok(Some(p))
}

/// Submit `n` operations (io_uring's SQEs): the number submitted, or
/// -errno if none was. Fewer than `n` are submitted when one fails (its
/// error is in `lwio_errmsg`) or when there is no room: staged reads (small
/// ones, into memory not from `lwio_buf_alloc`) hold a staging buffer until
/// reaped, so reap and submit the rest (with no room and nothing submitted,
/// -EAGAIN). Buffers must stay valid until reaped.
#[no_mangle]
pub unsafe extern "C" fn lwio_submit(
    c: *const LwioClient,
    ops: *const lwio_op,
    n: c_uint,
) -> c_int {
    guard(-libc::EIO, || {
        let c = match client_ref(c) {
            Ok(c) => c,
            Err(e) => return e,
        };
        if n == 0 {
            return 0;
        }
        if ops.is_null() {
            return fail(libc::EFAULT, "ops is NULL");
        }
        // SAFETY: the caller passes `n` operations.
        let ops = unsafe { std::slice::from_raw_parts(ops, n as usize) };
        let mut done: c_int = 0;
        // Issuing only queues the request messages: post them before
        // returning, so a program that waits on lwio_completion_fd (not in
        // lwio_reap, which would post them) has them on the wire.
        let mut conns: Vec<Connection> = Vec::new();
        let r = (|| {
            for op in ops {
                match issue(op) {
                    Ok(p) => {
                        let conn = p.batch.connection();
                        if !conns.contains(&conn) {
                            conns.push(conn);
                        }
                        lock(&c.queue).push_back(p);
                        done += 1;
                    }
                    Err(NotIssued::Full) => {
                        return if done > 0 {
                            done
                        } else {
                            fail(libc::EAGAIN, "no room: reap completions first")
                        }
                    }
                    Err(NotIssued::Err(e)) => return if done > 0 { done } else { e },
                }
            }
            done
        })();
        for c in &conns {
            c.flush();
        }
        r
    })
}

/// Reap completions into `cqes`: waits until at least `min` operations have
/// completed, then adds those already complete, up to `max`. Completions
/// come in submission order. The number reaped, or -errno. An operation
/// whose requests a lost connection took runs that part again here, after
/// the reconnect (waiting up to `op_timeout`), as the blocking calls do: a
/// network blip does not fail it.
#[no_mangle]
pub unsafe extern "C" fn lwio_reap(
    c: *const LwioClient,
    cqes: *mut lwio_cqe,
    min: c_uint,
    max: c_uint,
) -> c_int {
    guard(-libc::EIO, || {
        let c = match client_ref(c) {
            Ok(c) => c,
            Err(e) => return e,
        };
        if max == 0 {
            return 0;
        }
        if cqes.is_null() {
            return fail(libc::EFAULT, "cqes is NULL");
        }
        let (min, max) = (min.min(max) as usize, max as usize);
        let mut got = 0usize;
        // Run the completion queue once per call for the non-blocking
        // looks; a blocking wait drives it itself.
        let mut drive = true;
        while got < max {
            let front = {
                let mut q = lock(&c.queue);
                let Some(p) = q.front_mut() else { break };
                // Already complete (or, past `min`, not): non-blocking look.
                let all = p.batch.poll(&mut drive);
                if all || got < min {
                    q.pop_front()
                } else {
                    None
                }
            };
            let Some(mut p) = front else { break };
            p.batch.wait_all();
            let cqe = p.finish();
            // SAFETY: `got < max` and the caller passes room for `max`.
            unsafe { cqes.add(got).write(cqe) };
            got += 1;
        }
        got as c_int
    })
}

/// A file descriptor that becomes readable when a batch operation of `c`
/// completes (an eventfd: read its 8-byte counter to clear it, then
/// `lwio_reap(c, cqes, 0, max)`), for epoll, poll or select. Owned by the
/// library (closed by `lwio_disconnect`); interrupt completion mode only
/// (-EINVAL with LWIO_COMPLETION_POLL, whose completions are status-block
/// writes that wake nobody: poll with `lwio_reap`).
#[no_mangle]
pub unsafe extern "C" fn lwio_completion_fd(c: *const LwioClient) -> c_int {
    guard(-libc::EIO, || {
        let c = match client_ref(c) {
            Ok(c) => c,
            Err(e) => return e,
        };
        if c.client.completion() == Completion::Poll {
            return fail(
                libc::EINVAL,
                "no completion fd in poll mode: reap by polling",
            );
        }
        let mut n = lock(&c.notify);
        if let Some(fd) = n.as_ref() {
            return std::os::fd::AsRawFd::as_raw_fd(&**fd);
        }
        // SAFETY: eventfd(2) takes no pointers.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            let e = std::io::Error::last_os_error();
            return fail(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("eventfd: {e}"),
            );
        }
        // SAFETY: a new descriptor that nothing else owns.
        let fd =
            Arc::new(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
        c.client.set_completion_notify(Some(fd.clone()));
        *n = Some(fd);
        raw
    })
}

#[cfg(test)]
mod tests;
