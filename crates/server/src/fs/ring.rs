//! The per-reactor io_uring: file I/O submitted and reaped without blocking
//! by the reactor thread that owns it.
//!
//! A reactor owns one [`Ring`] and puts [`Ring::fd`] (an eventfd registered
//! with the ring) in its epoll set beside the completion channels. In a round
//! it pushes operations ([`Ring::read`], [`Ring::write`], [`Ring::writev`],
//! [`Ring::fsync`], [`Ring::cancel`]), then calls [`Ring::submit`] once: one
//! `io_uring_enter` for everything pushed, never waiting for a completion.
//! When the fd is readable it calls [`Ring::reap`], which hands back
//! `(user_data, res)` pairs exactly as the kernel gives them (`res` = bytes
//! transferred, possibly short, or `-errno`), and submits again if
//! [`Ring::has_unsubmitted`].
//!
//! Operations that do not fit (the submission queue is full, or as many
//! entries are with the kernel as the completion queue holds) wait in an
//! overflow queue and go to the kernel in later rounds, in order. Keeping at
//! most "completion queue size" entries with the kernel means the completion
//! queue cannot overflow; the kernel's `IORING_FEAT_NODROP` (required) and a
//! flush in [`Ring::reap`] cover it anyway. The number of operations pushed
//! and not yet reaped is capped ([`Ring::with_max_in_flight`]); beyond it a
//! push fails with [`PushError::Full`].
//!
//! Cancellation ([`Ring::cancel`]) is a request: the operation completes
//! once, with `-ECANCELED` or with its real result if the kernel had already
//! finished it (or cannot interrupt it). The `IORING_OP_ASYNC_CANCEL` entry's
//! own completion is consumed here and never reported. An operation still in
//! the overflow queue never reaches the kernel: it completes with
//! `-ECANCELED` at the next reap.
//!
//! Every operation holds its file's `Arc` until its completion is reaped, and
//! dropping the ring cancels and waits for whatever the kernel still has (see
//! `Drop`), so neither a file nor caller memory is released under the
//! kernel's feet.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring, Probe};
use lwio_proto::status::{STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_PARAMETER};
use lwio_proto::NtStatus;

/// The ring's user_data of an `IORING_OP_ASYNC_CANCEL` entry; the low bits
/// are the tag of the operation it cancels. Operation tags never have it.
const CANCEL_BIT: u64 = 1 << 63;

/// Why an operation was not accepted. Nothing was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// `max_in_flight` operations are pushed and not yet reaped.
    Full,
    /// Another operation pushed and not yet reaped has this user_data.
    DuplicateUserData,
    /// A length or iovec count that does not fit the ring's 32-bit fields.
    TooLarge,
}

impl PushError {
    /// The NTSTATUS a client should see for the refused operation.
    pub fn status(&self) -> NtStatus {
        match self {
            PushError::Full => STATUS_INSUFFICIENT_RESOURCES,
            PushError::DuplicateUserData | PushError::TooLarge => STATUS_INVALID_PARAMETER,
        }
    }
}

impl fmt::Display for PushError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PushError::Full => "io_uring: too many operations in flight",
            PushError::DuplicateUserData => "io_uring: user_data already in flight",
            PushError::TooLarge => "io_uring: length or iovec count over 32 bits",
        })
    }
}

impl std::error::Error for PushError {}

impl From<PushError> for io::Error {
    /// `Full` becomes `ENOMEM` and the others `EINVAL`, so
    /// [`super::io_error_status`] maps them like [`PushError::status`].
    fn from(e: PushError) -> io::Error {
        io::Error::from_raw_os_error(match e {
            PushError::Full => libc::ENOMEM,
            PushError::DuplicateUserData | PushError::TooLarge => libc::EINVAL,
        })
    }
}

/// One pushed, not yet reaped operation.
struct Live {
    user_data: u64,
    /// In the overflow queue: never seen by the kernel.
    queued: bool,
    /// An ASYNC_CANCEL for it has been queued or submitted.
    cancel_sent: bool,
    /// Kept until the completion is reaped: the fd stays open while the
    /// kernel may use it. `None` for an operation on a borrowed fd
    /// ([`Ring::read_fd`], [`Ring::write_fd`]), whose caller keeps it open.
    _file: Option<Arc<File>>,
    /// A writev's iovec array, which the kernel reads from this heap
    /// allocation (moving the `Live` does not move it).
    _iov: Option<Box<[libc::iovec]>>,
}

/// The descriptor of a read or write: a file the ring holds until the
/// completion is reaped (the reactors'), or a descriptor borrowed from a
/// caller that keeps it open until then (the backend's pool, whose callers
/// block until their operations are reaped).
pub enum FdRef<'a> {
    Owned(Arc<File>),
    Borrowed(BorrowedFd<'a>),
}

impl From<Arc<File>> for FdRef<'_> {
    fn from(f: Arc<File>) -> Self {
        FdRef::Owned(f)
    }
}

struct Slot {
    /// Bumped on every reuse, part of the tag: a stale tag (a cancel that
    /// outlived its target) never matches a newer operation.
    gen: u32,
    live: Option<Live>,
}

/// The operations pushed and not yet reaped, by tag
/// (`gen << 32 | index`) and by the caller's user_data.
#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<u32>,
    by_user: HashMap<u64, u32>,
}

fn tag(index: u32, gen: u32) -> u64 {
    (u64::from(gen) << 32) | u64::from(index)
}

fn index_of(tag: u64) -> usize {
    (tag & 0xffff_ffff) as usize
}

impl Slab {
    fn insert(&mut self, live: Live) -> u64 {
        let user = live.user_data;
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot { gen: 0, live: None });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.gen = (slot.gen + 1) & 0x7fff_ffff;
        slot.live = Some(live);
        self.by_user.insert(user, index);
        tag(index, slot.gen)
    }

    fn get_mut(&mut self, tag: u64) -> Option<&mut Live> {
        let slot = self.slots.get_mut(index_of(tag))?;
        if u64::from(slot.gen) != tag >> 32 {
            return None;
        }
        slot.live.as_mut()
    }

    /// Forget the operation `tag` (dropping its file and iovecs): its
    /// user_data, if it was live.
    fn remove(&mut self, tag: u64) -> Option<u64> {
        let live = self.get_mut(tag)?;
        let user = live.user_data;
        self.slots[index_of(tag)].live = None;
        self.free.push(index_of(tag) as u32);
        self.by_user.remove(&user);
        Some(user)
    }

    fn tag_of(&self, user: u64) -> Option<u64> {
        let &i = self.by_user.get(&user)?;
        Some(tag(i, self.slots[i as usize].gen))
    }

    fn len(&self) -> usize {
        self.by_user.len()
    }
}

/// A single-threaded io_uring for one reactor (see the module
/// documentation). `Send`, so it can be built before its thread starts, but
/// not `Sync`: one thread owns and drives it.
pub struct Ring {
    uring: IoUring,
    /// Registered with the ring: readable when completions were posted.
    efd: OwnedFd,
    slab: Slab,
    /// Entries waiting for room in the submission queue, in push order.
    overflow: VecDeque<squeue::Entry>,
    /// Results decided without the kernel (cancelled while queued).
    ready: Vec<(u64, i32)>,
    /// Entries (operations and cancels) put in the submission queue whose
    /// completions have not been reaped.
    with_kernel: usize,
    /// At most this many entries with the kernel: the completion queue size.
    kernel_cap: usize,
    max_in_flight: usize,
    enters: u64,
    /// Completions the kernel dropped (only without NODROP; logged).
    dropped_seen: u32,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: `Ring` is not `Send` automatically only because of the raw
// pointers in the iovec arrays it keeps for the kernel. It never dereferences
// them; what they point to is governed by the contract of `Ring::writev`
// (valid and untouched until the completion is reaped), which does not
// depend on the thread that holds the ring. The io_uring and eventfd are
// plain fds the kernel lets any thread use (requests submitted by a thread
// that exits are cancelled by the kernel and still complete, so `Drop`
// reaps them wherever it runs). `PhantomData<Cell<()>>` keeps it `!Sync`.
unsafe impl Send for Ring {}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("in_flight", &self.in_flight())
            .field("queued", &self.overflow.len())
            .field("with_kernel", &self.with_kernel)
            .field("max_in_flight", &self.max_in_flight)
            .field("submits", &self.enters)
            .finish()
    }
}

fn unavailable(what: &str, e: io::Error) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("io_uring unavailable ({what}: {e}); kernel.io_uring_disabled or a seccomp filter may forbid it"),
    )
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

impl Ring {
    /// [`Ring::with_max_in_flight`] with a cap of four times `entries`.
    pub fn new(entries: u32) -> io::Result<Ring> {
        Ring::with_max_in_flight(entries, entries as usize * 4)
    }

    /// A ring with `entries` submission entries (the kernel rounds up to a
    /// power of two; its completion queue is twice as large) accepting at
    /// most `max_in_flight` operations pushed and not yet reaped. Fails,
    /// with an error worth logging before falling back to the thread pool,
    /// where io_uring cannot be set up (`kernel.io_uring_disabled`,
    /// seccomp, an old kernel), lacks an opcode used here (read, write,
    /// readv, writev, fsync, async cancel) or `IORING_FEAT_NODROP`, or does
    /// not complete a NOP.
    pub fn with_max_in_flight(entries: u32, max_in_flight: usize) -> io::Result<Ring> {
        // SUBMIT_ALL (5.18): an entry that fails early does not stop the
        // rest of the batch from being submitted. Older kernels refuse the
        // flag; the ring then works without it.
        let mut uring = match IoUring::builder().setup_submit_all().build(entries) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                IoUring::new(entries).map_err(|e| unavailable("io_uring_setup", e))?
            }
            Err(e) => return Err(unavailable("io_uring_setup", e)),
        };
        if !uring.params().is_feature_nodrop() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "io_uring unavailable: the kernel lacks IORING_FEAT_NODROP (5.5+)",
            ));
        }
        let mut probe = Probe::new();
        uring
            .submitter()
            .register_probe(&mut probe)
            .map_err(|e| unavailable("IORING_REGISTER_PROBE", e))?;
        for (name, code) in [
            ("read", opcode::Read::CODE),
            ("write", opcode::Write::CODE),
            ("readv", opcode::Readv::CODE),
            ("writev", opcode::Writev::CODE),
            ("fsync", opcode::Fsync::CODE),
            ("async cancel", opcode::AsyncCancel::CODE),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "io_uring unavailable: the kernel does not support its {name} operation"
                    ),
                ));
            }
        }
        // A round trip proves submission works (a seccomp filter may allow
        // setup but not enter). Before the eventfd is registered, so it
        // leaves no wake-up behind.
        let nop = opcode::Nop::new().build().user_data(CANCEL_BIT);
        // SAFETY: a NOP references no memory.
        unsafe { uring.submission().push(&nop) }
            .map_err(|_| io::Error::other("io_uring: no room for a NOP in a new ring"))?;
        uring
            .submit_and_wait(1)
            .map_err(|e| unavailable("io_uring_enter", e))?;
        let ok = uring
            .completion()
            .next()
            .map(|c| c.user_data() == CANCEL_BIT && c.result() >= 0);
        if ok != Some(true) {
            return Err(io::Error::other(
                "io_uring unavailable: a NOP did not complete",
            ));
        }
        let efd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )?;
        uring
            .submitter()
            .register_eventfd(efd.as_raw_fd())
            .map_err(|e| unavailable("IORING_REGISTER_EVENTFD", e))?;
        let kernel_cap = uring.params().cq_entries() as usize;
        Ok(Ring {
            uring,
            efd,
            slab: Slab::default(),
            overflow: VecDeque::new(),
            ready: Vec::new(),
            with_kernel: 0,
            kernel_cap,
            max_in_flight: max_in_flight.max(1),
            enters: 0,
            dropped_seen: 0,
            _not_sync: PhantomData,
        })
    }

    /// The eventfd to poll for readability (`EPOLLIN`, level- or
    /// edge-triggered): it becomes readable when the kernel posts a
    /// completion (or a queued operation is cancelled) and is drained by
    /// [`Ring::reap`]. Valid as long as the ring.
    pub fn fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    /// Operations pushed and not yet reaped (queued, with the kernel, or
    /// complete and waiting for [`Ring::reap`]).
    pub fn in_flight(&self) -> usize {
        self.slab.len() + self.ready.len()
    }

    /// Operations in the overflow queue, not yet given to the kernel.
    pub fn queued(&self) -> usize {
        self.overflow
            .iter()
            .filter(|e| e.get_user_data() & CANCEL_BIT == 0)
            .count()
    }

    /// `io_uring_enter` calls made since creation (by `submit`, and by
    /// `reap` when it must flush an overflowed completion queue).
    pub fn submits(&self) -> u64 {
        self.enters
    }

    /// Whether entries wait to go to the kernel: call [`Ring::submit`] this
    /// round (after a `submit` that could not submit, or a `reap` that made
    /// room).
    pub fn has_unsubmitted(&mut self) -> bool {
        !self.uring.submission().is_empty() || self.room_for_overflow()
    }

    fn room_for_overflow(&mut self) -> bool {
        !self.overflow.is_empty()
            && self.with_kernel < self.kernel_cap
            && !self.uring.submission().is_full()
    }

    fn check_push(&self, user_data: u64) -> Result<(), PushError> {
        if self.in_flight() >= self.max_in_flight {
            return Err(PushError::Full);
        }
        if self.slab.by_user.contains_key(&user_data) {
            return Err(PushError::DuplicateUserData);
        }
        Ok(())
    }

    /// Record an operation and queue its entry (built with the tag).
    ///
    /// # Safety
    /// The entry's memory must satisfy the contract of the public method
    /// that built it; a borrowed fd must stay open until the completion is
    /// reaped.
    unsafe fn push_op(
        &mut self,
        user_data: u64,
        file: FdRef<'_>,
        iov: Option<Box<[libc::iovec]>>,
        build: impl FnOnce(types::Fd, Option<&[libc::iovec]>) -> squeue::Entry,
    ) -> u64 {
        let (fd, file) = match file {
            FdRef::Owned(f) => (types::Fd(f.as_raw_fd()), Some(f)),
            FdRef::Borrowed(fd) => (types::Fd(fd.as_raw_fd()), None),
        };
        let entry = build(fd, iov.as_deref());
        let tag = self.slab.insert(Live {
            user_data,
            queued: false,
            cancel_sent: false,
            _file: file,
            _iov: iov,
        });
        // SAFETY: the caller's contract covers the entry's memory; the
        // file and iovecs are held by the slab entry just made, until the
        // completion is reaped.
        unsafe { self.enqueue(entry.user_data(tag)) };
        tag
    }

    /// Check and push a one-buffer operation of `len` bytes.
    ///
    /// # Safety
    /// As [`Ring::push_op`].
    unsafe fn push_buf(
        &mut self,
        user_data: u64,
        file: FdRef<'_>,
        len: usize,
        build: impl FnOnce(types::Fd, u32) -> squeue::Entry,
    ) -> Result<(), PushError> {
        self.check_push(user_data)?;
        let len = u32::try_from(len).map_err(|_| PushError::TooLarge)?;
        // SAFETY: passed on from the caller.
        unsafe { self.push_op(user_data, file, None, |fd, _| build(fd, len)) };
        Ok(())
    }

    /// Put `entry` in the submission queue, or in the overflow queue when
    /// that is full, when the kernel has as many entries as the completion
    /// queue holds, or when earlier entries already wait there.
    ///
    /// # Safety
    /// Whatever the entry references stays valid until its completion is
    /// reaped.
    unsafe fn enqueue(&mut self, entry: squeue::Entry) {
        if self.overflow.is_empty() && self.with_kernel < self.kernel_cap {
            // SAFETY: the caller guarantees the entry's memory and fd.
            if unsafe { self.uring.submission().push(&entry) }.is_ok() {
                self.with_kernel += 1;
                return;
            }
        }
        if entry.get_user_data() & CANCEL_BIT == 0 {
            if let Some(live) = self.slab.get_mut(entry.get_user_data()) {
                live.queued = true;
            }
        }
        self.overflow.push_back(entry);
    }

    /// Move what fits from the overflow queue to the submission queue.
    fn refill(&mut self) {
        let mut sq = self.uring.submission();
        while self.with_kernel < self.kernel_cap && !sq.is_full() {
            let Some(entry) = self.overflow.pop_front() else {
                break;
            };
            // SAFETY: the entry was built by a push whose contract keeps
            // its memory valid until the completion is reaped, and its
            // file and iovecs are held by its slab entry; a cancel entry
            // references no memory.
            if unsafe { sq.push(&entry) }.is_err() {
                self.overflow.push_front(entry);
                break;
            }
            self.with_kernel += 1;
            let ud = entry.get_user_data();
            if ud & CANCEL_BIT == 0 {
                if let Some(live) = self.slab.get_mut(ud) {
                    live.queued = false;
                }
            }
        }
    }

    /// Read up to `len` bytes at `offset` (0 or `u64::MAX` = "current
    /// position" for pipes and other streams) of `file` into `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must stay valid for writes, and must not be read
    /// or written by anyone else, until this operation's completion has been
    /// returned by [`Ring::reap`] (or the ring has been dropped, which waits
    /// for it); a [`FdRef::Borrowed`] descriptor must stay open as long.
    pub unsafe fn read<'a>(
        &mut self,
        user_data: u64,
        file: impl Into<FdRef<'a>>,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> Result<(), PushError> {
        // SAFETY: the caller keeps the buffer valid and unshared until the
        // completion is reaped.
        unsafe {
            self.push_buf(user_data, file.into(), len, |fd, len| {
                opcode::Read::new(fd, ptr, len).offset(offset).build()
            })
        }
    }

    /// Write `len` bytes from `ptr` at `offset` of `file`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must stay valid for reads, and must not be written
    /// by anyone else, until this operation's completion has been returned
    /// by [`Ring::reap`] (or the ring has been dropped); a
    /// [`FdRef::Borrowed`] descriptor must stay open as long.
    pub unsafe fn write<'a>(
        &mut self,
        user_data: u64,
        file: impl Into<FdRef<'a>>,
        ptr: *const u8,
        len: usize,
        offset: u64,
    ) -> Result<(), PushError> {
        // SAFETY: the caller keeps the buffer valid and unwritten until the
        // completion is reaped.
        unsafe {
            self.push_buf(user_data, file.into(), len, |fd, len| {
                opcode::Write::new(fd, ptr, len).offset(offset).build()
            })
        }
    }

    /// Write the buffers `iovecs` designate, in order, at `offset` of
    /// `file` (one `pwritev`). The ring keeps the iovec array itself until
    /// the completion is reaped; more than `IOV_MAX` entries fail in the
    /// kernel with `-EINVAL`.
    ///
    /// # Safety
    /// Every `[iov_base, iov_base + iov_len)` must stay valid for reads, and
    /// must not be written by anyone else, until this operation's completion
    /// has been returned by [`Ring::reap`] (or the ring has been dropped).
    pub unsafe fn writev(
        &mut self,
        user_data: u64,
        file: Arc<File>,
        iovecs: Vec<libc::iovec>,
        offset: u64,
    ) -> Result<(), PushError> {
        self.check_push(user_data)?;
        let n = u32::try_from(iovecs.len()).map_err(|_| PushError::TooLarge)?;
        let iov = iovecs.into_boxed_slice();
        // SAFETY: the caller keeps the buffers valid and unwritten until the
        // completion is reaped; the iovec array is the boxed slice that the
        // slab entry owns until then (its heap address does not change when
        // the box moves into the entry).
        unsafe {
            self.push_op(user_data, FdRef::Owned(file), Some(iov), |fd, iov| {
                let p = iov.map_or(std::ptr::null(), |v| v.as_ptr());
                opcode::Writev::new(fd, p, n).offset(offset).build()
            })
        };
        Ok(())
    }

    /// `fsync` (or `fdatasync` with `datasync`) `file`.
    pub fn fsync(
        &mut self,
        user_data: u64,
        file: Arc<File>,
        datasync: bool,
    ) -> Result<(), PushError> {
        self.check_push(user_data)?;
        let flags = if datasync {
            types::FsyncFlags::DATASYNC
        } else {
            types::FsyncFlags::empty()
        };
        // SAFETY: an fsync references no memory; the slab entry holds the
        // file until the completion is reaped.
        unsafe {
            self.push_op(user_data, FdRef::Owned(file), None, |fd, _| {
                opcode::Fsync::new(fd).flags(flags).build()
            })
        };
        Ok(())
    }

    /// Ask to cancel the operation `user_data`. False if no such operation
    /// is pushed and unreaped (it has completed, or never existed). Else it
    /// will complete exactly once: still queued here, with `-ECANCELED` at
    /// the next [`Ring::reap`] (the fd is made readable); with the kernel,
    /// after an `IORING_OP_ASYNC_CANCEL` (submitted by the next
    /// [`Ring::submit`]), with `-ECANCELED` or with its real result when it
    /// had finished or cannot be interrupted. The cancel entry's own
    /// completion is not reported. Asking twice sends one cancel.
    pub fn cancel(&mut self, user_data: u64) -> bool {
        let Some(tag) = self.slab.tag_of(user_data) else {
            return false;
        };
        let Some(live) = self.slab.get_mut(tag) else {
            return false;
        };
        if live.queued {
            self.overflow.retain(|e| e.get_user_data() != tag);
            self.slab.remove(tag);
            self.ready.push((user_data, -libc::ECANCELED));
            // Wake the reactor for the result; a full counter (EAGAIN)
            // is readable already.
            let _ = rustix::io::write(&self.efd, &1u64.to_ne_bytes());
            return true;
        }
        if !live.cancel_sent {
            live.cancel_sent = true;
            let entry = opcode::AsyncCancel::new(tag)
                .build()
                .user_data(CANCEL_BIT | tag);
            // SAFETY: an ASYNC_CANCEL references no memory. It goes after
            // its target in submission order, so the kernel has the target
            // when it looks for it.
            unsafe { self.enqueue(entry) };
        }
        true
    }

    /// Submit everything in the submission queue (first refilled from the
    /// overflow queue) with one `io_uring_enter`, without waiting for any
    /// completion. Returns how many entries the kernel took (cancel entries
    /// included); 0 without an enter call when there was nothing to submit.
    /// `EINTR`, `EAGAIN` and `EBUSY` leave the entries queued and return
    /// `Ok(0)`: submit again next round ([`Ring::has_unsubmitted`]). Other
    /// errors mean the ring is unusable.
    pub fn submit(&mut self) -> io::Result<usize> {
        self.refill();
        if self.uring.submission().is_empty() {
            return Ok(0);
        }
        self.enters += 1;
        match self.uring.submitter().submit() {
            Ok(n) => Ok(n),
            Err(e) if is_transient(&e) => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// [`Ring::submit`], then block until a completion can be reaped, or
    /// for at most `timeout` (`None`: no limit). Returns at once when a
    /// result is already waiting or nothing is with the kernel. For a
    /// caller that owns the ring's thread (the backend's pool); a reactor
    /// polls [`Ring::fd`] instead. Interrupted waits return early: callers
    /// reap and wait again.
    pub fn submit_and_wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.submit()?;
        if !self.ready.is_empty() || self.with_kernel == 0 {
            return Ok(());
        }
        let Some(timeout) = timeout else {
            self.enters += 1;
            return match self.uring.submit_and_wait(1) {
                Err(e) if !is_transient(&e) => Err(e),
                _ => Ok(()),
            };
        };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut pfd = libc::pollfd {
            fd: self.efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one live pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Append the completions available now to `out` as `(user_data, res)`
    /// (`res` as the kernel gives it: bytes transferred, maybe short, or
    /// `-errno`), without blocking; drain the fd; move what now fits from
    /// the overflow queue to the submission queue (submit it with
    /// [`Ring::submit`]). Each operation's file and iovecs are released
    /// here, and from here its buffer is the caller's again. Returns the
    /// number of completions appended.
    pub fn reap(&mut self, out: &mut Vec<(u64, i32)>) -> usize {
        let before = out.len();
        // The counter first: a completion posted after the CQ is drained
        // below makes the fd readable again, none is missed.
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.efd, &mut v);
        out.append(&mut self.ready);
        loop {
            for cqe in self.uring.completion() {
                self.with_kernel -= 1;
                let ud = cqe.user_data();
                if ud & CANCEL_BIT != 0 {
                    // An ASYNC_CANCEL's answer (0, -ENOENT: already done,
                    // -EALREADY: running, asked to stop): its target
                    // completes on its own.
                    continue;
                }
                match self.slab.remove(ud) {
                    Some(user) => out.push((user, cqe.result())),
                    None => tracing::error!(tag = ud, "io_uring completion for no operation"),
                }
            }
            // With NODROP the kernel keeps completions that did not fit the
            // CQ and posts them when asked to (an enter with GETEVENTS).
            // Not expected: no more entries are with the kernel than the CQ
            // holds.
            if !self.uring.submission().cq_overflow() {
                break;
            }
            self.enters += 1;
            // SAFETY: submits nothing and waits for nothing; no argument.
            let r = unsafe {
                self.uring.submitter().enter::<libc::sigset_t>(
                    0,
                    0,
                    io_uring::EnterFlags::GETEVENTS.bits(),
                    None,
                )
            };
            if let Err(e) = r {
                if !is_transient(&e) {
                    tracing::error!(error = %e, "io_uring: cannot flush overflowed completions");
                }
                break;
            }
        }
        let dropped = self.uring.completion().overflow();
        if dropped != self.dropped_seen {
            // Only without NODROP, which `with_max_in_flight` requires.
            tracing::error!(dropped, "io_uring dropped completions");
            self.dropped_seen = dropped;
        }
        self.refill();
        out.len() - before
    }
}

impl Ring {
    /// Cancel every operation and block until each has completed, its
    /// completion appended to `out` like [`Ring::reap`] does (`-ECANCELED`,
    /// or the real result of what finished first). Operations in the
    /// overflow queue were never seen by the kernel: `-ECANCELED` at once.
    /// Aborts the process if the ring cannot be waited on, rather than
    /// return with I/O in flight. Only `Drop` calls it.
    fn cancel_all_and_wait(&mut self, out: &mut Vec<(u64, i32)>) {
        for e in std::mem::take(&mut self.overflow) {
            let ud = e.get_user_data();
            if ud & CANCEL_BIT == 0 {
                if let Some(user) = self.slab.remove(ud) {
                    out.push((user, -libc::ECANCELED));
                }
            }
        }
        let mut to_cancel: Vec<u64> = self
            .slab
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.live.is_some())
            .map(|(i, s)| tag(i as u32, s.gen))
            .collect();
        loop {
            self.reap(out);
            if self.slab.len() == 0 {
                break;
            }
            {
                let mut sq = self.uring.submission();
                while let Some(&t) = to_cancel.last() {
                    let c = opcode::AsyncCancel::new(t)
                        .build()
                        .user_data(CANCEL_BIT | t);
                    // SAFETY: an ASYNC_CANCEL references no memory.
                    if unsafe { sq.push(&c) }.is_err() {
                        break;
                    }
                    to_cancel.pop();
                    self.with_kernel += 1;
                }
            }
            self.enters += 1;
            // While cancels are left over (the queue was full of
            // operations), submit without waiting: those operations may
            // never complete until cancelled.
            let r = if to_cancel.is_empty() {
                self.uring.submit_and_wait(1)
            } else {
                self.uring.submit()
            };
            match r {
                Ok(_) => {}
                // Interrupted, or the kernel short of memory for a moment.
                Err(e) if is_transient(&e) || e.raw_os_error() == Some(libc::ENOMEM) => {
                    std::thread::yield_now()
                }
                Err(e) => {
                    // The ring cannot be waited on (a broken fd: a bug).
                    // Returning would let the kernel write into memory freed
                    // after the ring; stopping the process is what is left.
                    eprintln!("lwio: fatal: io_uring wait failed with I/O in flight: {e}");
                    std::process::abort();
                }
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY (why this waits): the kernel reads and writes the callers'
        // buffers (and reads the iovec arrays and uses the fds held here)
        // until each operation completes, and closing the ring does not wait
        // for that (requests running in io-wq workers are cancelled
        // asynchronously by the ring's exit work). Callers may free their
        // buffers as soon as the ring is gone, so it must not be gone before
        // every operation the kernel has seen has completed: cancel them
        // all and wait (blocking, only here). The results have no one left
        // to go to.
        let mut discard = Vec::new();
        self.cancel_all_and_wait(&mut discard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io_phase::{io_error_status, poll_readable};
    use std::collections::HashSet;
    use std::io::{Read as _, Write as _};
    use std::time::{Duration, Instant};

    /// These tests exercise io_uring itself: where it is unavailable they
    /// fail, saying so, rather than pass without testing anything.
    fn ring(entries: u32, max_in_flight: usize) -> Ring {
        Ring::with_max_in_flight(entries, max_in_flight).unwrap_or_else(|e| {
            panic!("the ring tests need io_uring, which is unavailable here: {e}")
        })
    }

    fn readable(r: &Ring, ms: u64) -> bool {
        poll_readable(&[r.fd()], Duration::from_millis(ms)).unwrap()[0]
    }

    /// Poll, reap and submit until `out` holds `n` completions.
    fn collect(r: &mut Ring, out: &mut Vec<(u64, i32)>, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while out.len() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} completions: {r:?}",
                out.len()
            );
            readable(r, 100);
            r.reap(out);
            r.submit().unwrap();
        }
    }

    /// No completion arrives within 200 ms.
    fn nothing_more(r: &mut Ring) {
        let mut more = Vec::new();
        readable(r, 200);
        r.reap(&mut more);
        assert!(more.is_empty(), "unexpected completions {more:?}");
    }

    fn pipe() -> (Arc<File>, File) {
        let (rx, tx) = std::io::pipe().unwrap();
        (
            Arc::new(File::from(std::os::fd::OwnedFd::from(rx))),
            File::from(std::os::fd::OwnedFd::from(tx)),
        )
    }

    /// `len` bytes meant for file offset `at`: every byte depends on its
    /// offset (and `seed`), so data landing at the wrong place shows.
    fn bytes_for(at: u64, len: usize, seed: u8) -> Vec<u8> {
        (at..at + len as u64)
            .map(|p| (p.wrapping_mul(0x9e37_79b9) >> 13) as u8 ^ seed)
            .collect()
    }

    #[test]
    fn writev_at_odd_offset_reads_back_byte_exact() {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let f = Arc::new(tmp.reopen().unwrap());
        let off = 12_345u64;
        let parts = [
            bytes_for(off, 4097, 1),
            bytes_for(off + 4097, 13, 2),
            bytes_for(off + 4110, 70_001, 3),
        ];
        let whole: Vec<u8> = parts.concat();
        let mut back = vec![0u8; whole.len() + 100];
        let mut r = ring(8, 8);
        let iov: Vec<libc::iovec> = parts
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        // SAFETY: `parts` outlives the ring (declared before it) and is only
        // read while the write is in flight.
        unsafe { r.writev(1, f.clone(), iov, off) }.unwrap();
        assert_eq!(r.submit().unwrap(), 1);
        let mut out = Vec::new();
        collect(&mut r, &mut out, 1);
        assert_eq!(out, [(1, whole.len() as i32)]);

        let disk = std::fs::read(tmp.path()).unwrap();
        assert_eq!(disk.len(), off as usize + whole.len());
        assert!(disk[..off as usize].iter().all(|&b| b == 0));
        assert_eq!(&disk[off as usize..], &whole[..]);

        // Through the ring: short at end of file, as the kernel gives it.
        // SAFETY: `back` outlives the ring and is untouched until reaped.
        unsafe { r.read(2, f.clone(), back.as_mut_ptr(), back.len(), off) }.unwrap();
        r.fsync(3, f.clone(), true).unwrap();
        r.fsync(4, f, false).unwrap();
        assert_eq!(r.submit().unwrap(), 3);
        out.clear();
        collect(&mut r, &mut out, 3);
        out.sort();
        assert_eq!(out, [(2, whole.len() as i32), (3, 0), (4, 0)]);
        assert_eq!(&back[..whole.len()], &whole[..]);
        assert_eq!(r.in_flight(), 0);
    }

    const RECORD: usize = 64;
    const HALF: usize = 500;

    /// A file holding `HALF` records, read back by ops 0..HALF, and
    /// `HALF` records written by ops HALF..2*HALF beyond them.
    struct Mixed {
        tmp: tempfile::NamedTempFile,
        file: Arc<File>,
        wdata: Vec<Vec<u8>>,
        bufs: Vec<Vec<u8>>,
    }

    const WRITES_AT: u64 = 100_000;

    impl Mixed {
        fn new() -> Mixed {
            let tmp = tempfile::NamedTempFile::new().unwrap();
            let initial = bytes_for(0, HALF * RECORD, 1);
            std::fs::write(tmp.path(), &initial).unwrap();
            let file = Arc::new(tmp.reopen().unwrap());
            Mixed {
                tmp,
                file,
                wdata: (0..HALF)
                    .map(|i| bytes_for(WRITES_AT + (i * RECORD) as u64, RECORD, 2))
                    .collect(),
                bufs: vec![vec![0u8; RECORD]; HALF],
            }
        }

        fn push_all(&mut self, r: &mut Ring) {
            for i in 0..HALF {
                let at = (i * RECORD) as u64;
                let p = self.bufs[i].as_mut_ptr();
                // SAFETY: the buffers outlive the ring and are not touched
                // until every completion has been reaped (`check`).
                unsafe { r.read(i as u64, self.file.clone(), p, RECORD, at) }.unwrap();
                let p = self.wdata[i].as_ptr();
                // SAFETY: as above, only read.
                unsafe {
                    r.write(
                        (HALF + i) as u64,
                        self.file.clone(),
                        p,
                        RECORD,
                        WRITES_AT + at,
                    )
                }
                .unwrap();
            }
        }

        fn check(&self, out: &[(u64, i32)]) {
            assert_eq!(out.len(), 2 * HALF);
            let ids: HashSet<u64> = out.iter().map(|c| c.0).collect();
            assert_eq!(ids, (0..2 * HALF as u64).collect::<HashSet<_>>());
            for &(id, res) in out {
                assert_eq!(res, RECORD as i32, "op {id}");
            }
            for i in 0..HALF {
                let want = bytes_for((i * RECORD) as u64, RECORD, 1);
                assert_eq!(self.bufs[i], want, "read {i}");
            }
            let disk = std::fs::read(self.tmp.path()).unwrap();
            let written: Vec<u8> = self.wdata.concat();
            assert_eq!(&disk[WRITES_AT as usize..], &written[..]);
        }
    }

    #[test]
    fn a_thousand_ops_in_one_round_take_one_enter() {
        let mut m = Mixed::new();
        let mut r = ring(1024, 2 * HALF);
        m.push_all(&mut r);
        assert_eq!(r.queued(), 0);
        assert_eq!(r.in_flight(), 2 * HALF);
        let before = r.submits();
        assert_eq!(r.submit().unwrap(), 2 * HALF);
        assert_eq!(r.submits(), before + 1, "one io_uring_enter for the round");
        let mut out = Vec::new();
        collect(&mut r, &mut out, 2 * HALF);
        nothing_more(&mut r);
        assert_eq!(r.in_flight(), 0);
        m.check(&out);
    }

    #[test]
    fn a_small_ring_carries_the_rest_over_rounds() {
        let mut m = Mixed::new();
        let mut r = ring(64, 2 * HALF);
        m.push_all(&mut r);
        // 64 in the submission queue, the rest in the overflow queue.
        assert_eq!(r.queued(), 2 * HALF - 64);
        let before = r.submits();
        assert_eq!(r.submit().unwrap(), 64);
        let mut out = Vec::new();
        collect(&mut r, &mut out, 2 * HALF);
        nothing_more(&mut r);
        assert!(
            r.submits() - before >= (2 * HALF as u64).div_ceil(64),
            "{} enters",
            r.submits() - before
        );
        assert_eq!((r.in_flight(), r.queued()), (0, 0));
        m.check(&out);
    }

    #[test]
    fn cancel_completes_a_blocked_read_with_ecanceled() {
        let (rx, _tx) = pipe();
        let mut buf = [0u8; 16];
        let mut r = ring(8, 16);
        // SAFETY: `buf` outlives the ring and is untouched until reaped.
        unsafe { r.read(7, rx.clone(), buf.as_mut_ptr(), buf.len(), 0) }.unwrap();
        assert_eq!(r.submit().unwrap(), 1);
        assert!(!readable(&r, 100), "an empty pipe completed a read");
        assert!(!r.cancel(99), "no such operation");
        assert!(r.cancel(7));
        assert!(r.cancel(7), "asking twice is harmless");
        assert_eq!(r.submit().unwrap(), 1, "one cancel entry");
        let mut out = Vec::new();
        collect(&mut r, &mut out, 1);
        // The cancel entry's own completion is not reported.
        nothing_more(&mut r);
        assert_eq!(out, [(7, -libc::ECANCELED)]);
        assert_eq!(r.in_flight(), 0);
        assert!(!r.cancel(7), "completed");
    }

    #[test]
    fn cancel_of_a_queued_op_never_reaches_the_kernel() {
        let (rx, mut tx) = pipe();
        let mut bufs = [[0u8; 4]; 9];
        let mut r = ring(8, 16);
        for (i, b) in bufs.iter_mut().enumerate() {
            // SAFETY: `bufs` outlives the ring, untouched until reaped.
            unsafe { r.read(i as u64, rx.clone(), b.as_mut_ptr(), 4, 0) }.unwrap();
        }
        assert_eq!(r.queued(), 1, "the ninth waits for room");
        assert!(!readable(&r, 0));
        assert!(r.cancel(8));
        assert!(readable(&r, 0), "a queued op's cancel wakes the reactor");
        let mut out = Vec::new();
        assert_eq!(r.reap(&mut out), 1);
        assert_eq!(out, [(8, -libc::ECANCELED)]);
        assert_eq!(r.queued(), 0);
        // The other eight are with the kernel once submitted; cancel them
        // all while the queue is still full: the cancels wait for room.
        for i in 0..8 {
            assert!(r.cancel(i));
        }
        assert_eq!(r.submit().unwrap(), 8);
        assert!(r.has_unsubmitted(), "cancels left for the next round");
        out.clear();
        collect(&mut r, &mut out, 8);
        nothing_more(&mut r);
        out.sort();
        let want: Vec<(u64, i32)> = (0..8).map(|i| (i, -libc::ECANCELED)).collect();
        assert_eq!(out, want);
        // The pipe's data goes to whoever reads next: no cancelled read
        // took it.
        tx.write_all(b"data").unwrap();
        let mut got = [0u8; 4];
        (&*rx).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"data");
        assert!(bufs.iter().all(|b| b == &[0u8; 4]));
    }

    #[test]
    fn fd_readable_after_a_completion_and_not_before() {
        let (rx, mut tx) = pipe();
        let mut buf = [0u8; 16];
        let mut r = ring(8, 8);
        assert!(!readable(&r, 0), "a new ring is not readable");
        // SAFETY: `buf` outlives the ring and is untouched until reaped.
        unsafe { r.read(1, rx.clone(), buf.as_mut_ptr(), buf.len(), 0) }.unwrap();
        assert!(!readable(&r, 0), "pushed, not submitted");
        r.submit().unwrap();
        assert!(!readable(&r, 200), "submitted, not complete");
        tx.write_all(b"hello").unwrap();
        assert!(readable(&r, 5000), "complete: the fd must be readable");
        let mut out = Vec::new();
        assert_eq!(r.reap(&mut out), 1);
        assert_eq!(out, [(1, 5)]);
        assert_eq!(&buf[..5], b"hello");
        assert!(!readable(&r, 0), "reap drains the fd");
    }

    #[test]
    fn dropping_a_ring_with_reads_in_flight_cancels_them() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (rx, mut tx) = pipe();
            let mut a = [0u8; 8];
            let mut b = [0u8; 8];
            let mut r = ring(8, 8);
            // SAFETY: `a` and `b` outlive the ring (dropped below, which
            // waits for both reads) and are untouched until then.
            unsafe {
                r.read(1, rx.clone(), a.as_mut_ptr(), 8, 0).unwrap();
                r.submit().unwrap();
                // Pushed, never submitted.
                r.read(2, rx.clone(), b.as_mut_ptr(), 8, 0).unwrap();
            }
            assert_eq!(r.in_flight(), 2);
            drop(r);
            // Neither read is still waiting for data.
            tx.write_all(b"x").unwrap();
            let mut got = [0u8; 1];
            (&*rx).read_exact(&mut got).unwrap();
            assert_eq!(&got, b"x");
            assert_eq!((a, b), ([0u8; 8], [0u8; 8]));
            done_tx.send(()).unwrap();
        });
        done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("dropping the ring hung or panicked");
    }

    /// What `Drop` relies on: once `cancel_all_and_wait` returns, every
    /// operation (submitted, pushed but not submitted, queued) has
    /// completed and released its file.
    #[test]
    fn cancel_all_and_wait_leaves_nothing_with_the_kernel() {
        let (rx, mut tx) = pipe();
        let mut bufs = [[0u8; 4]; 14];
        let mut r = ring(8, 16);
        for (i, b) in bufs.iter_mut().enumerate() {
            // SAFETY: `bufs` outlives the ring, untouched until reaped.
            unsafe { r.read(i as u64, rx.clone(), b.as_mut_ptr(), 4, 0) }.unwrap();
            if i == 3 {
                // 0..=3 submitted; 4..=11 pushed only (the SQ holds 8);
                // 12 and 13 queued.
                r.submit().unwrap();
            }
        }
        assert_eq!((r.in_flight(), r.queued()), (14, 2));
        assert_eq!(Arc::strong_count(&rx), 15);
        let mut out = Vec::new();
        r.cancel_all_and_wait(&mut out);
        out.sort();
        let want: Vec<(u64, i32)> = (0..14).map(|i| (i, -libc::ECANCELED)).collect();
        assert_eq!(out, want);
        assert_eq!(r.in_flight(), 0);
        assert_eq!(Arc::strong_count(&rx), 1, "every op released its file");
        tx.write_all(b"left").unwrap();
        let mut got = [0u8; 4];
        (&*rx).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"left", "no read is still waiting on the pipe");
        // The ring still works afterwards.
        // SAFETY: as above.
        unsafe { r.read(20, rx.clone(), bufs[0].as_mut_ptr(), 4, 0) }.unwrap();
        r.submit().unwrap();
        tx.write_all(b"more").unwrap();
        out.clear();
        collect(&mut r, &mut out, 1);
        assert_eq!(out, [(20, 4)]);
        drop(r);
        assert_eq!(&bufs[0], b"more");
    }

    #[test]
    fn the_in_flight_cap_refuses_with_insufficient_resources() {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), bytes_for(0, 100, 9)).unwrap();
        let f = Arc::new(tmp.reopen().unwrap());
        let mut bufs = [[0u8; 10]; 5];
        let mut r = ring(8, 4);
        let mut push = |r: &mut Ring, i: usize| {
            let p = bufs[i].as_mut_ptr();
            // SAFETY: `bufs` outlives the ring, untouched until reaped.
            unsafe { r.read(i as u64, f.clone(), p, 10, 10 * i as u64) }
        };
        for i in 0..4 {
            push(&mut r, i).unwrap();
        }
        let e = push(&mut r, 4).unwrap_err();
        assert_eq!(e, PushError::Full);
        assert_eq!(e.status(), STATUS_INSUFFICIENT_RESOURCES);
        assert_eq!(
            io_error_status(&io::Error::from(e)),
            STATUS_INSUFFICIENT_RESOURCES
        );
        assert_eq!(r.in_flight(), 4);
        r.submit().unwrap();
        // Complete but not reaped: still counted.
        assert!(readable(&r, 5000));
        assert_eq!(push(&mut r, 4).unwrap_err(), PushError::Full);
        let mut out = Vec::new();
        collect(&mut r, &mut out, 4);
        assert_eq!(r.in_flight(), 0);
        push(&mut r, 4).unwrap();
        let dup = push(&mut r, 4).unwrap_err();
        assert_eq!(dup, PushError::DuplicateUserData);
        assert_eq!(dup.status(), STATUS_INVALID_PARAMETER);
        r.submit().unwrap();
        collect(&mut r, &mut out, 5);
        out.sort();
        let want: Vec<(u64, i32)> = (0..5).map(|i| (i, 10)).collect();
        assert_eq!(out, want);
        drop(r);
        let data = bytes_for(0, 100, 9);
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(&b[..], &data[10 * i..10 * i + 10]);
        }
    }
}
