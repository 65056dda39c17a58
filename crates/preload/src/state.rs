//! Which descriptors are files of an `lwio mount`, their lwio files, the
//! clients that serve them, and the counters of the exit report.
//!
//! The kernel's descriptor stays the authority for everything but data: it
//! holds the file offset (read and write move it with lseek, so dup, fork
//! and exec share it as they do), the open flags, locks and the file's
//! lifetime. This library only carries the bytes, over RDMA, with its own
//! lwio file opened from the mount's handoff (docs/preload.md).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use lwio_client::handoff::{Handoff, HANDOFF_MAX, IOC_HANDOFF};
use lwio_client::{Client, ClientOptions, Completion, File, OpenOptions};

use crate::real;

/// A file of a mount served by this library.
pub struct Open {
    pub file: File,
    pub dev: u64,
    pub ino: u64,
    /// Back on the kernel path for good (mmap, O_APPEND, a lost server).
    pub fallback: AtomicBool,
    /// Written over RDMA since the kernel last refreshed its attributes.
    pub dirty: AtomicBool,
}

pub enum Slot {
    /// Not ours: every call goes to the C library.
    Kernel,
    Lwio(Arc<Open>),
}

/// Everything this library keeps. A forked child starts a new one (the
/// parent's clients belong to the parent's threads and connections, and
/// are never touched, not even dropped, in the child).
pub struct State {
    pub fds: RwLock<HashMap<c_int, Slot>>,
    /// Clients by connection key; None = connecting failed (not retried).
    clients: Mutex<HashMap<String, Option<Client>>>,
    /// Files (dev, ino) that were mapped: the kernel path serves them from
    /// then on, in this process.
    mapped: Mutex<HashSet<(u64, u64)>>,
    /// Devices known to be (or not to be) an `lwio mount`.
    devs: Mutex<HashMap<u64, (bool, Instant)>>,
}

impl State {
    fn new() -> State {
        State {
            fds: RwLock::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            mapped: Mutex::new(HashSet::new()),
            devs: Mutex::new(HashMap::new()),
        }
    }
}

static STATE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());

/// The value behind `slot`, made by `make` on first use. Such values are
/// leaked, never freed (a forked child replaces its pointer and leaves the
/// parent's value be), so the reference is good for the whole process.
pub fn leaked<T>(slot: &AtomicPtr<T>, make: impl FnOnce() -> T) -> &'static T {
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: leaked, never freed.
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Box::new(make()));
    match slot.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: just leaked.
        Ok(_) => unsafe { &*fresh },
        Err(other) => {
            // SAFETY: `fresh` was never shared; `other` is leaked.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: leaked, never freed.
            unsafe { &*other }
        }
    }
}

pub fn state() -> &'static State {
    leaked(&STATE, State::new)
}

/// In the child of fork: start over (the parent's state is leaked as is).
pub fn reset_after_fork() {
    STATE.store(Box::into_raw(Box::new(State::new())), Ordering::Release);
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ------------------------------------------------------------ settings

pub static DISABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while this thread runs this library's own code: the C calls it
    /// makes (the client's sockets, /proc reads) go straight through.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Marks the thread busy until dropped.
pub struct Busy(());

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = BUSY.try_with(|b| b.set(false));
    }
}

/// Enter this library's own code, unless the thread already is in it (or
/// is being torn down) or interception is off.
pub fn busy() -> Option<Busy> {
    if DISABLED.load(Ordering::Relaxed) {
        return None;
    }
    match BUSY.try_with(|b| b.replace(true)) {
        Ok(false) => Some(Busy(())),
        _ => None,
    }
}

/// Mark a thread of this library (AIO workers) busy for its whole life.
pub fn busy_forever() {
    let _ = BUSY.try_with(|b| b.set(true));
}

// ------------------------------------------------------------ counters

#[derive(Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// fstat, lseek, fsync, fdatasync, aio bookkeeping on our files.
    pub other: AtomicU64,
    pub files: AtomicU64,
    /// Files of a mount left to the kernel path, and why.
    pub fallback_files: AtomicU64,
    /// Data calls on such files (served by the kernel through the mount).
    pub fallback_calls: AtomicU64,
    pub reasons: Mutex<Vec<String>>,
}

pub static COUNTERS: std::sync::LazyLock<Counters> = std::sync::LazyLock::new(Counters::default);

pub fn count(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub fn fell_back(why: String) {
    count(&COUNTERS.fallback_files, 1);
    let mut r = lock(&COUNTERS.reasons);
    if r.len() < 8 && !r.contains(&why) {
        r.push(why);
    }
}

pub fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e };
}

pub fn errno() -> c_int {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() }
}

/// One line on stderr (for what a user must know: a refused handoff, a
/// server that cannot be reached), at most once per message.
pub fn warn_once(msg: String) {
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut s = lock(&SAID);
    if s.contains(&msg) || s.len() > 32 {
        return;
    }
    eprintln!("lwio-preload: {msg}");
    s.push(msg);
}

// ------------------------------------------------------------ classifying

pub fn kernel_stat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: an all-zero stat is a valid value; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable and large enough.
    (unsafe { real::fstat(fd, &mut st) } == 0).then_some(st)
}

/// Whether device `dev` is an `lwio mount` (from /proc/self/mountinfo).
fn is_lwio_dev(dev: u64) -> bool {
    let s = state();
    if let Some((yes, when)) = lock(&s.devs).get(&dev) {
        if *yes || when.elapsed() < Duration::from_secs(2) {
            return *yes;
        }
    }
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found = false;
    let mut devs = lock(&s.devs);
    for line in text.lines() {
        // ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [OPTIONAL…] - FSTYPE SOURCE …
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split(' ');
        let (fstype, source) = (r.next().unwrap_or(""), r.next().unwrap_or(""));
        let Some((maj, min)) = left.split(' ').nth(2).and_then(|d| d.split_once(':')) else {
            continue;
        };
        let (Ok(maj), Ok(min)) = (maj.parse::<u32>(), min.parse::<u32>()) else {
            continue;
        };
        let d = libc::makedev(maj, min);
        // `fuse.lwio`, or `fuse` with lwio's source name (a mount made
        // without a subtype shows only that).
        let yes = fstype == "fuse.lwio" || (fstype == "fuse" && source.starts_with("lwio:"));
        devs.insert(d, (yes, Instant::now()));
        found |= d == dev && yes;
    }
    devs.entry(dev).or_insert((false, Instant::now()));
    found
}

/// Whether `fd` is a regular file of an `lwio mount`: its (dev, ino).
pub fn mount_file(fd: c_int) -> Option<(u64, u64)> {
    let st = kernel_stat(fd)?;
    (st.st_mode & libc::S_IFMT == libc::S_IFREG && is_lwio_dev(st.st_dev))
        .then_some((st.st_dev, st.st_ino))
}

/// The slot of `fd`, classifying it on first sight.
pub fn slot(fd: c_int) -> Option<Arc<Open>> {
    if fd < 0 {
        return None;
    }
    let s = state();
    {
        let fds = s.fds.read().unwrap_or_else(|p| p.into_inner());
        match fds.get(&fd) {
            Some(Slot::Kernel) => return None,
            Some(Slot::Lwio(o)) => {
                if o.fallback.load(Ordering::Relaxed) {
                    count(&COUNTERS.fallback_calls, 1);
                    return None;
                }
                return Some(o.clone());
            }
            None => {}
        }
    }
    let found = classify(fd);
    let mut fds = s.fds.write().unwrap_or_else(|p| p.into_inner());
    let slot = match &found {
        Some(o) => Slot::Lwio(o.clone()),
        None => Slot::Kernel,
    };
    fds.insert(fd, slot);
    found
}

fn classify(fd: c_int) -> Option<Arc<Open>> {
    let (dev, ino) = mount_file(fd)?;
    if lock(&state().mapped).contains(&(dev, ino)) {
        count(&COUNTERS.fallback_calls, 1);
        return None;
    }
    // SAFETY: F_GETFL takes no argument.
    let flags = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    if flags < 0 || flags & libc::O_PATH != 0 {
        return None;
    }
    if flags & libc::O_APPEND != 0 {
        // An append must land at the end the server sees at that moment;
        // the kernel path (through the mount) does that.
        fell_back("O_APPEND (appends go through the mount)".into());
        return None;
    }
    let mut buf = vec![0u8; HANDOFF_MAX];
    // SAFETY: the reply buffer is HANDOFF_MAX bytes, as the ioctl number
    // encodes.
    let r = unsafe { libc::ioctl(fd, IOC_HANDOFF as _, buf.as_mut_ptr()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        let why = match e.raw_os_error() {
            Some(libc::EPERM) => {
                "the mount refused the handoff (another user's mount, or -o nopreload)".to_string()
            }
            Some(libc::ENOTTY) | Some(libc::ENOSYS) => {
                "the mount does not hand files off (an older lwio)".to_string()
            }
            _ => format!("handoff: {e}"),
        };
        warn_once(format!("{why}: its files go through the mount"));
        fell_back(why);
        return None;
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let h = match std::str::from_utf8(&buf[..len])
        .map_err(|e| e.to_string())
        .and_then(Handoff::decode)
    {
        Ok(h) => h,
        Err(e) => {
            warn_once(format!("bad handoff from the mount: {e}"));
            fell_back("bad handoff".into());
            return None;
        }
    };
    let client = client_for(&h)?;
    let acc = flags & libc::O_ACCMODE;
    let mut o = OpenOptions::read_only();
    o.0.read = acc != libc::O_WRONLY;
    o.0.write = acc != libc::O_RDONLY;
    o.0.no_buffering = flags & libc::O_DIRECT != 0;
    o.0.set_sync_flags(flags);
    let file = match client.open(&h.path, &o) {
        Ok(f) => f,
        Err(e) => {
            fell_back(format!("open: {e}"));
            return None;
        }
    };
    // The name may have moved on since the mount opened the file.
    match file.stat() {
        Ok(a) if a.ino == h.ino => {}
        _ => {
            fell_back("the path names another file now".into());
            return None;
        }
    }
    count(&COUNTERS.files, 1);
    Some(Arc::new(Open {
        file,
        dev,
        ino,
        fallback: AtomicBool::new(false),
        dirty: AtomicBool::new(false),
    }))
}

fn client_for(h: &Handoff) -> Option<Client> {
    let key = h.connection_key();
    let mut clients = lock(&state().clients);
    if let Some(c) = clients.get(&key) {
        if c.is_none() {
            fell_back("the server could not be reached".into());
        }
        return c.clone();
    }
    // Polling by default: a waiting call spins on its status block for
    // the engine's spin budget (200 µs), then sends INTERRUPT and sleeps,
    // so the CPU it burns is bounded by that budget per call, and a 4 KiB
    // read costs 22 µs instead of 135 µs (bench/RESULTS.md).
    let completion = match std::env::var("LWIO_PRELOAD_COMPLETION").as_deref() {
        Ok("interrupt") => Completion::Interrupt,
        _ => Completion::Poll,
    };
    // Bulk settings, as `lwio mount` uses.
    let opts = ClientOptions {
        completion,
        client_name: "lwio-preload".into(),
        credits: 32,
        read_chunk: 512 * 1024,
        stage_slots: 16,
        write_chunk: 16 * 1024,
        send_slots: 64,
        connect_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    let c = match h.connect(opts) {
        Ok(c) => Some(c),
        Err(e) => {
            warn_once(format!(
                "connecting to {} failed ({e}): files go through the mount",
                h.authority
            ));
            fell_back("the server could not be reached".into());
            None
        }
    };
    clients.insert(key, c.clone());
    c
}

/// `fd` is closed (or replaced): forget it.
pub fn forget(fd: c_int) -> Option<Slot> {
    state()
        .fds
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&fd)
}

/// `to` now refers to what `from` does (dup).
pub fn duplicate(from: c_int, to: c_int) {
    let s = state();
    let mut fds = s.fds.write().unwrap_or_else(|p| p.into_inner());
    let copy = match fds.get(&from) {
        Some(Slot::Lwio(o)) => Some(Slot::Lwio(o.clone())),
        Some(Slot::Kernel) => Some(Slot::Kernel),
        None => None,
    };
    match copy {
        Some(c) => fds.insert(to, c),
        None => fds.remove(&to),
    };
}

/// Make the kernel's view of `fd`'s file right before the kernel serves
/// it: fresh attributes (the size our writes changed) and no cached pages
/// older than our writes.
pub fn kernel_coherent(fd: c_int, o: &Open) {
    if o.dirty.swap(false, Ordering::Relaxed) {
        refresh_attrs(fd);
    }
    // SAFETY: plain advice on a descriptor; failure changes nothing.
    unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// Have the kernel ask the mount for the file's attributes now.
pub fn refresh_attrs(fd: c_int) {
    // SAFETY: an all-zero statx is valid; the kernel fills it; the path is
    // an empty C string used with AT_EMPTY_PATH.
    unsafe {
        let mut sx: libc::statx = std::mem::zeroed();
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut sx,
        );
    }
}

/// Put `o` on the kernel path for good (coherently).
pub fn fall_back(fd: c_int, o: &Open, why: &str) {
    if !o.fallback.swap(true, Ordering::AcqRel) {
        kernel_coherent(fd, o);
        fell_back(why.to_string());
    }
}

/// `fd` is about to be mapped: its file goes to the kernel path in this
/// process from now on, every descriptor of it.
pub fn mapping(fd: c_int) {
    let Some((dev, ino)) = mount_file(fd) else {
        return;
    };
    let s = state();
    let newly = lock(&s.mapped).insert((dev, ino));
    let ours: Vec<Arc<Open>> = s
        .fds
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .filter_map(|v| match v {
            Slot::Lwio(o) if o.dev == dev && o.ino == ino => Some(o.clone()),
            _ => None,
        })
        .collect();
    for o in &ours {
        fall_back(fd, o, "mmap (a mapped file goes through the mount)");
    }
    if newly && ours.is_empty() {
        // SAFETY: plain advice on a descriptor.
        unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}
