//! An open file: reads and writes over its RDMA channel, registered
//! buffers, the side-channel calls on its handle, and its close.

use super::*;

use crate::batch::{Batch, End, Short};

/// A buffer whose registration the client caches (see
/// [`Client::register_buffer`]). It dereferences to `[u8]`.
/// [`File::read_registered`] reads into a range of it of at least 1 KiB
/// (`BOUNCE_THRESHOLD`) directly, with no per-call registration and no copy,
/// and without a `&mut [u8]` over the bytes the peer writes. A `read_at`
/// into a slice of it is read as into any slice (staged, or registered for
/// the call from `ClientOptions::register_threshold` up): the cached
/// registration is never used behind a Rust reference. Dropping it releases
/// the registration.
pub struct RegisteredBuf {
    pub(crate) mem: Arc<lwio_rdma::RegBuf>,
    pub(crate) len: usize,
    /// Every channel's registration cache holds it.
    pub(crate) engines: Vec<std::sync::Weak<Engine>>,
}

impl RegisteredBuf {
    /// The buffer's length, without forming a slice over its bytes (which
    /// a read through another handle may be placing).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer is empty (never: `register_buffer` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegisteredBuf({} bytes)", self.len)
    }
}

impl std::ops::Deref for RegisteredBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation (page-aligned, zero-initialised, at least
        // `len` bytes) is owned by `mem` and alive while `self` is. Nothing
        // writes it while this shared view lives: the region's own key is
        // never sent, and the peer can write it only through a window bound
        // for a read into it, which needs a `&mut [u8]` of it (so this
        // shared borrow has ended) and returns only after every such window
        // is invalidated. (During such a read the caller's `&mut` is live
        // while the peer writes; see the SAFETY note in `File::read_impl`.)
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for RegisteredBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this view exclusive among
        // Rust references, and no remote write is possible while it lives
        // unless it is handed to a read (see `File::read_impl`).
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr(), self.len) }
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // Explicit release: the cache entry (and its registration) goes.
        // Even without it the entry would keep the memory alive.
        for e in self.engines.iter().filter_map(|e| e.upgrade()) {
            e.cache_release(self.mem.as_ptr() as usize);
        }
    }
}

impl Client {
    /// Allocate a zeroed buffer of `len` bytes and register it in the
    /// client's registration cache: large reads into it with
    /// [`File::read_registered`] skip both the per-call registration and the
    /// staging copy, and large writes from it skip the copy into send
    /// slots. The registration lives
    /// until the buffer is dropped (or, past the cache bounds, is evicted
    /// and redone on the next use).
    pub fn register_buffer(&self, len: usize) -> Result<RegisteredBuf> {
        let mem = lwio_rdma::RegBuf::new(len.max(1).next_multiple_of(4096))?;
        let mem = Arc::new(mem);
        for e in self.0.channels() {
            e.cache_insert(mem.clone())?;
        }
        Ok(RegisteredBuf {
            mem,
            len,
            engines: self.0.channels().iter().map(Arc::downgrade).collect(),
        })
    }
}

/// An open, registered file. After a reconnect it registers again before
/// its next request (docs/reconnect.md).
pub struct File {
    pub(crate) client: Client,
    /// Where the file is registered now (channel, Fid, handle).
    pub(crate) route: Mutex<reconnect::Route>,
    pub(crate) export: String,
    pub(crate) path: String,
    /// How it was opened (a reopen by path after a server restart uses the
    /// same access, never create, truncate or exclusive).
    pub(crate) open: lwio_side::types::OpenOptions,
    pub(crate) mode: u32,
    /// Whose ids it was opened with (a reopen uses them again).
    pub(crate) caller: Option<lwio_side::types::Creds>,
    /// The server's identity of the file (0 = unknown).
    pub(crate) file_id: u64,
    pub(crate) no_buffering: bool,
    pub(crate) closed: bool,
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "File({}/{}, fid {})", self.export, self.path, self.fid())
    }
}

impl File {
    /// The Fid the file has on its RDMA connection (a reconnect changes it).
    pub fn fid(&self) -> u16 {
        self.now().fid
    }

    /// The engine of the channel this file is registered on now.
    pub(crate) fn channel_engine(&self) -> Arc<Engine> {
        self.now().engine
    }

    /// The limits of one request on the connection this file is
    /// registered on now, for callers that split their calls into
    /// requests themselves ([`File::batch`]).
    pub fn request_limits(&self) -> RequestLimits {
        let e = self.channel_engine();
        RequestLimits {
            max_read: e.max_read(),
            max_write: e.max_write(),
            max_write_message: e.max_write_message(true),
            stage_slots: e.config().stage_slots,
        }
    }

    /// A [`Batch`] for a call at `offset` of this file, on the channel it
    /// is registered on now (no re-registration: after a lost connection
    /// its requests fail with it), for callers that issue and reap the
    /// parts of their calls themselves (the C batch API, POSIX AIO).
    pub fn batch(&self, offset: u64, short: Short) -> Batch {
        let r = self.now();
        Batch::new(r.engine, r.fid, offset, short)
    }

    /// The engine and Fid to issue requests on, registered on the current
    /// connection (after a reconnect, waiting for it up to `op_timeout`).
    pub(crate) fn current(&self) -> Result<(Arc<Engine>, u16)> {
        self.retry(|r| Ok((r.engine.clone(), r.fid)))
    }

    /// The route as it stands (no re-registration).
    pub(crate) fn now(&self) -> reconnect::Route {
        self.route.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The route as it stands, or `None` while another thread holds it to
    /// renew it (a re-registration, a failover: side-channel calls that
    /// can take as long as the server does). Async callers use this: a
    /// runtime thread must not block on that lock.
    pub(crate) fn try_now(&self) -> Option<reconnect::Route> {
        match self.route.try_lock() {
            Ok(g) => Some(g.clone()),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner().clone()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// fstat(2) of the open file, from the server (by its handle).
    pub fn stat(&self) -> Result<lwio_side::types::AttrX> {
        self.retry(|r| self.client.0.side_once(|s| s.stat_handle(r.handle)))
    }

    /// The RDMA channel this file's requests use (0 = the first).
    pub fn channel(&self) -> usize {
        self.now().channel
    }

    /// Read into `buf` at `offset`; returns the bytes read (short only at end
    /// of file; 0 at or past it).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.retry(|r| self.read_impl(r, buf, offset, false))
    }

    /// Read `range` of a registered buffer at `offset`, directly into the
    /// buffer from 1 KiB up through its cached registration (no copy, no
    /// per-call registration), without a `&mut [u8]` over the bytes while
    /// the peer writes them: the pointer comes from the buffer's own
    /// memory, as its registration's does. (`read_at(&mut buf[range], ..)`
    /// reads the same bytes but never through the cached registration.)
    /// Returns the bytes read (short only at end of file; 0 at or past it).
    pub fn read_registered(
        &self,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
        offset: u64,
    ) -> Result<usize> {
        let len = range.end.checked_sub(range.start).ok_or_else(|| {
            Error::InvalidArgument(format!("range {range:?} ends before it starts"))
        })?;
        if range.end > buf.len {
            return Err(Error::InvalidArgument(format!(
                "range {range:?} outside a buffer of {} bytes",
                buf.len
            )));
        }
        if len == 0 {
            return Ok(0);
        }
        offset
            .checked_add(len as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        self.retry(|r| self.read_registered_once(r, buf, range.clone(), offset))
    }

    pub(crate) fn read_registered_once(
        &self,
        r: &reconnect::Route,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
        offset: u64,
    ) -> Result<usize> {
        let len = range.len();
        let e = &*r.engine;
        if len >= engine::BOUNCE_THRESHOLD {
            // In bounds (checked above), so no wrap.
            let ptr = buf.mem.as_ptr().wrapping_add(range.start);
            // SAFETY: `buf` is exclusively borrowed for the whole call, so no
            // Rust reference to its memory exists meanwhile (the buffer hands
            // them out only through `&self`/`&mut self`), and none is formed
            // here: `ptr` comes from the `RegBuf`'s own pointer, like the
            // cached registration the peer writes through, so the peer's
            // writes alias no live reference. Every window over the range is
            // one-shot and `fence_group` returns only once all are
            // invalidated and completed (or the QP is in error); the cache
            // entry keeps the memory alive.
            let dst = unsafe { e.user_dst(ptr, len, false) };
            if let Some(x) = self.read_direct(r, dst, len, offset, false) {
                return x;
            }
        }
        // Staged: no window covers the buffer, so a slice of it is fine.
        let slice = &mut buf[range];
        let b = Batch::new(r.engine.clone(), r.fid, offset, Short::Ends);
        self.read_chunks(b, len, false, Some(slice))
    }

    pub(crate) fn read_impl(
        &self,
        r: &reconnect::Route,
        buf: &mut [u8],
        offset: u64,
        vectored: bool,
    ) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let e = &*r.engine;
        if buf.len() >= engine::BOUNCE_THRESHOLD {
            let (ptr, len) = (buf.as_mut_ptr(), buf.len());
            let per_call = len >= e.cfg.register_threshold;
            // SAFETY: `ptr` is derived from `buf`, exclusively borrowed for
            // this whole call and not used until we return. `slice_dst`
            // registers it for this call (or gives `None`, and we stage),
            // never through the registration cache, so every write the peer
            // makes goes through a pointer derived from `buf`, as Stacked and
            // Tree Borrows allow while `buf` itself is not used. Every window
            // over it is bound one-shot for exactly one request's range
            // inside it, and `read_direct` fences the group before it
            // returns (or the queue pair is in the error state, where no
            // remote access is executed); the per-call registration is
            // dropped there too, so no remote write reaches the buffer after
            // the borrow ends. A slice of a `RegisteredBuf` is read the same
            // way; `File::read_registered` is its zero-copy path through the
            // cached registration.
            let dst = unsafe { e.slice_dst(ptr, len, per_call) };
            if let Some(x) = self.read_direct(r, dst, len, offset, vectored) {
                return x;
            }
        }
        let len = buf.len();
        let b = Batch::new(r.engine.clone(), r.fid, offset, Short::Ends);
        self.read_chunks(b, len, vectored, Some(buf))
    }

    /// Read `len` bytes at `offset` straight into the caller memory that
    /// `Engine::user_dst` returned, fenced before this returns (the batch
    /// it lands through fences it); `None` when it returned none (or
    /// failed): the caller stages instead.
    pub(crate) fn read_direct(
        &self,
        r: &reconnect::Route,
        dst: Result<Option<engine::UserDst>>,
        len: usize,
        offset: u64,
        vectored: bool,
    ) -> Option<Result<usize>> {
        match dst {
            Ok(None) => None,
            Ok(Some(dst)) => {
                let mut b = Batch::new(r.engine.clone(), r.fid, offset, Short::Ends);
                b.land_in(dst);
                Some(self.read_chunks(b, len, vectored, None))
            }
            Err(err) => {
                debug!(error = %err, len, "cannot register the caller's buffer; staging");
                None
            }
        }
    }

    /// Read `blen` bytes through `b`, pipelined up to the credits (and
    /// the staging buffers): into the batch's caller memory, or staged and
    /// copied into `staged`.
    pub(crate) fn read_chunks(
        &self,
        mut b: Batch,
        blen: usize,
        vectored: bool,
        mut staged: Option<&mut [u8]>,
    ) -> Result<usize> {
        let e = b.engine().clone();
        let page = e.client_page_size();
        // Into registered caller memory a READ is one request up to the
        // server's MAX_MESSAGE (VEC_READ stays within the window).
        let direct = b.lands_in_caller();
        let chunk = if direct && !vectored {
            e.max_read_direct()
        } else {
            e.max_read()
        };
        let depth = if direct {
            usize::from(e.credits()).max(1)
        } else {
            usize::from(e.credits()).clamp(1, e.cfg.stage_slots)
        };
        loop {
            while !b.ended() && b.issued() < blen && b.outstanding() < depth {
                let len = chunk.min(blen - b.issued());
                // VEC_READ needs a last region that is a multiple of 512.
                let vec = (vectored && len.is_multiple_of(512)).then_some(page);
                if let Err(err) = b.read(len, vec) {
                    b.fail(err);
                }
            }
            let Some(l) = b.reap() else {
                break;
            };
            if let Some(buf) = staged.as_deref_mut() {
                l.copy_into(buf);
            }
        }
        self.read_result(b.finish())
    }

    /// A read's result from its batch's end: the bytes read, short at the
    /// end of the file; or the error.
    pub(crate) fn read_result(&self, (total, end): (usize, Option<End>)) -> Result<usize> {
        match end {
            None | Some(End::Short) | Some(End::Status(STATUS_END_OF_FILE)) => Ok(total),
            Some(End::Status(st)) => Err(status_error(
                format!("READ of {}/{}", self.export, self.path),
                st,
            )),
            Some(End::Failed(err)) => Err(err),
        }
    }

    /// A write's result from its batch's end: every byte written, or the
    /// first error.
    pub(crate) fn write_result(&self, (total, end): (usize, Option<End>)) -> Result<usize> {
        match end {
            None | Some(End::Short) => Ok(total),
            Some(End::Status(st)) => Err(status_error(
                format!("WRITE to {}/{}", self.export, self.path),
                st,
            )),
            Some(End::Failed(err)) => Err(err),
        }
    }

    /// Vectored read (VEC_READ, each page exposed through its own one-shot
    /// window) into several buffers.
    pub fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut tmp = vec![0u8; total];
        let n = self.retry(|r| self.read_impl(r, &mut tmp, offset, true))?;
        let mut o = 0;
        for b in bufs.iter_mut() {
            if o >= n {
                break;
            }
            let k = b.len().min(n - o);
            b[..k].copy_from_slice(&tmp[o..o + k]);
            o += k;
        }
        Ok(n)
    }

    /// Write all of `buf` at `offset` (split into WRITE requests of the
    /// server's MaxRecvBufferSize, pipelined up to the credits).
    ///
    /// A request the lost connection left unanswered is sent again after
    /// the reconnect, before this returns (docs/reconnect.md, ordering).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        self.retry(|r| self.write_impl(r, buf, offset, false))
    }

    /// Vectored write: VEC_WRITE (without COLLAPSE).
    pub fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<usize> {
        let data: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.retry(|r| self.write_impl(r, &data, offset, true))
    }

    pub(crate) fn write_impl(
        &self,
        r: &reconnect::Route,
        buf: &[u8],
        offset: u64,
        vectored: bool,
    ) -> Result<usize> {
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let (e, fid) = (&*r.engine, r.fid);
        let page = e.client_page_size();
        let mut chunk = e.max_write();
        if self.no_buffering && chunk >= usize::from(page) {
            // Unbuffered files need aligned pieces: whole pages per request.
            chunk -= chunk % usize::from(page);
        }
        // Larger than one request: fragmented messages (docs/protocol.md
        // §5.12), one request each — the whole write when it fits in one,
        // else messages of half the largest, so two are in flight.
        // Large writes go out from the caller's memory, registered (a
        // `RegisteredBuf`'s cached registration, or one for this call):
        // nothing is copied into send slots.
        let zero_copy = buf.len() > chunk && e.max_write_message(true) > chunk;
        let mut b = Batch::new(r.engine.clone(), fid, offset, Short::Fails);
        if zero_copy {
            // SAFETY: `buf` stays borrowed (allocated and unchanged) for
            // this whole call, and the batch that sends from the
            // registration fences every send from it (`Engine::fence_sends`)
            // when it is finished or dropped, before this returns.
            if let Some(src) = unsafe { e.write_source(buf, true) }.unwrap_or(None) {
                b.send_from(src, true);
            }
        }
        let zero_copy = b.sends_from_caller();
        let msg_max = e.max_write_message(zero_copy);
        let plain = chunk;
        let mut message = false;
        if buf.len() > chunk && msg_max > chunk {
            message = true;
            chunk = if buf.len() <= msg_max {
                buf.len()
            } else {
                msg_max / 2
            };
            if self.no_buffering && chunk >= usize::from(page) && chunk < buf.len() {
                chunk -= chunk % usize::from(page);
            }
        }
        // Fewer credits than when the write was planned (the server took
        // back an idle connection's, before a message or while it waited to
        // go): smaller messages, or plain requests.
        let shrink = |chunk: &mut usize, message: &mut bool| {
            let fits = e.max_write_message(zero_copy);
            if fits > plain {
                *chunk = fits;
                if self.no_buffering && *chunk >= usize::from(page) {
                    *chunk -= *chunk % usize::from(page);
                }
            } else {
                *message = false;
                *chunk = plain;
            }
        };
        let depth = usize::from(e.credits()).max(1);
        loop {
            while !b.ended() && b.issued() < buf.len() && b.outstanding() < depth {
                let issued = b.issued();
                let len = chunk.min(buf.len() - issued);
                let data = &buf[issued..issued + len];
                let r = if message {
                    b.write_message(data, vectored.then_some(page))
                } else if vectored {
                    b.vec_write(page, data)
                } else {
                    b.write(data)
                };
                match r {
                    Ok(()) => {}
                    Err(_) if message && e.max_write_message(zero_copy) < len => {
                        shrink(&mut chunk, &mut message);
                    }
                    Err(x) => b.fail(x),
                }
            }
            if b.reap().is_none() {
                break;
            }
        }
        self.write_result(b.finish())
    }

    /// Write `page` repeated to fill `total` bytes at `offset` using
    /// VEC_WRITE with COLLAPSE (only the first page crosses the wire) when
    /// legal — file opened with `no_buffering`, `page` one client page —
    /// otherwise plain writes. Returns the bytes written.
    pub fn write_repeated_at(&self, page: &[u8], total: u64, offset: u64) -> Result<u64> {
        let e = self.channel_engine();
        let ps = usize::from(e.client_page_size());
        let sps = usize::from(e.server_page_size());
        let legal =
            self.no_buffering && page.len() == ps && (ps.max(sps) % ps.min(sps).max(1) == 0);
        let mut done = 0u64;
        if legal {
            // The server's window, or up to its MAX_MESSAGE when it takes
            // longer COLLAPSE writes (docs/protocol.md §5.12); at most the
            // 65,535 pages NumPages counts.
            let max_req = (e.max_read_direct() as u64)
                .min(u64::from(u16::MAX) * ps as u64)
                .max(ps as u64);
            while done < total {
                let len = (total - done).min(max_req) as u32;
                let data = &page[..(len as usize).min(ps)];
                let at = offset + done;
                let w = self.retry(|r| {
                    let e = &r.engine;
                    let req = e.issue_vec_write(r.fid, at, ps as u16, len, data, true)?;
                    e.wait(req)
                })?;
                match w {
                    (n, STATUS_SUCCESS) if n == len => done += u64::from(len),
                    (_, st) => return Err(status_error("VEC_WRITE (COLLAPSE)", st)),
                }
            }
            return Ok(done);
        }
        let mut block = Vec::new();
        while block.len() < 64 * 1024 && !page.is_empty() {
            block.extend_from_slice(page);
        }
        while done < total && !block.is_empty() {
            let len = (total - done).min(block.len() as u64) as usize;
            self.write_at(&block[..len], offset + done)?;
            done += len as u64;
        }
        Ok(done)
    }

    /// CANCEL: every outstanding I/O of this file is asked to cancel; those
    /// the server still can stop complete with STATUS_CANCELLED
    /// (docs/protocol.md §5.9 says which cannot).
    pub fn cancel(&self) -> Result<()> {
        let (e, fid) = self.current()?;
        let r = e.issue_cancel(fid)?;
        match e.wait(r)? {
            (_, STATUS_SUCCESS) => Ok(()),
            (_, st) => Err(status_error("CANCEL", st)),
        }
    }

    /// CANCEL the one outstanding request `req` of this file (nothing if it
    /// has completed): only it completes with STATUS_CANCELLED.
    pub fn cancel_request(&self, req: lwio_proto::client::ReqId) -> Result<()> {
        let r = self.now();
        let (e, fid) = (r.engine, r.fid);
        let Some(r) = e.issue_cancel_request(fid, req)? else {
            return Ok(());
        };
        match e.wait(r)? {
            (_, STATUS_SUCCESS) => Ok(()),
            (_, st) => Err(status_error("CANCEL", st)),
        }
    }

    /// The file size (side channel).
    pub fn len(&self) -> Result<u64> {
        Ok(self.stat()?.size)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Truncate or extend (side channel).
    pub fn set_len(&self, size: u64) -> Result<()> {
        self.retry(|r| self.client.0.side_once(|s| s.set_size(r.handle, size)))
    }

    /// fsync(2) on the server: data and metadata reach stable storage.
    pub fn sync_all(&self) -> Result<()> {
        self.sync(false)
    }

    /// fdatasync(2) on the server.
    pub fn sync_data(&self) -> Result<()> {
        self.sync(true)
    }

    /// Whether [`File::sync_data`] and [`File::sync_all`] go over the RDMA
    /// connection (a FLUSH) rather than the side channel.
    pub fn syncs_on_rdma(&self) -> bool {
        self.route().is_ok_and(|r| r.engine.server_flushes())
    }

    /// A FLUSH on the file's RDMA connection where the server serves it
    /// (docs/protocol.md §5.13): one request beside the file's I/O, no
    /// side-channel round trip; else the side channel's `Fsync`.
    pub(crate) fn sync(&self, data_only: bool) -> Result<()> {
        self.retry(|r| {
            if !r.engine.server_flushes() {
                return self.client.0.side_once(|s| s.fsync(r.handle, data_only));
            }
            let req = r.engine.issue_flush(r.fid, data_only)?;
            match r.engine.wait(req)? {
                (_, STATUS_SUCCESS) => Ok(()),
                (_, st) => Err(status_error(
                    if data_only {
                        "FLUSH (fdatasync)"
                    } else {
                        "FLUSH (fsync)"
                    },
                    st,
                )),
            }
        })
    }

    /// A side-channel call on this open file's handle (fstat, fchmod,
    /// fallocate, a lock, …). When the connection is lost under it, the
    /// client connects again, the file is registered (or reopened) on the
    /// new session, and the call is made again with the file's new
    /// handle. The outer error is the connection's; the inner one is the
    /// server's answer, with its code.
    pub fn side<T>(
        &self,
        mut f: impl FnMut(&mut crate::side_client::SideClient, u64) -> lwio_side::Result<T>,
    ) -> Result<lwio_side::Result<T>> {
        self.retry(|r| {
            self.client.0.side_once(|s| match f(s, r.handle) {
                // Lost: through `retry`, which reconnects and reopens.
                Err(e) if e.code == ErrorCode::Disconnected => Err(e),
                answer => Ok(answer),
            })
        })
    }

    /// The side-channel handle of this open file (for side-channel calls
    /// that act on an open file, through [`Client::side`]; [`File::side`]
    /// keeps it current across a reconnect).
    pub fn handle(&self) -> u64 {
        self.now().handle
    }

    /// The export and the path within it that this file was opened as.
    pub fn export_path(&self) -> (&str, &str) {
        (&self.export, &self.path)
    }

    /// CLOSE on the RDMA channel, then close the side-channel handle.
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    pub(crate) fn close_inner(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let r = self.retry(|r| {
            let e = &r.engine;
            let rdma = e.issue_close(r.fid).and_then(|x| e.wait(x));
            let side = self.client.0.side_once(|s| s.close(r.handle));
            Ok((rdma?, side))
        });
        let (rdma, side) = match r {
            // Nothing of it is open any more.
            Err(Error::Stale(_)) => return Ok(()),
            r => r?,
        };
        match rdma {
            (_, STATUS_SUCCESS) => {}
            (_, st) => return Err(status_error("CLOSE", st)),
        }
        side?;
        Ok(())
    }
}

impl Drop for File {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            // Dropped in async code: the blocking side-channel client must
            // not run here. Close on a helper thread.
            self.closed = true;
            let (client, r) = (self.client.clone(), self.now());
            let _ = std::thread::Builder::new()
                .name("lwio-file-close".into())
                .spawn(move || close_once(&client, &r));
            return;
        }
        // Best effort, without a reconnect: a drop must not wait out
        // `op_timeout` for a server that is gone (its durable grace closes
        // the file there). `File::close` reconnects and reports.
        self.closed = true;
        close_once(&self.client, &self.now());
    }
}

/// Close a dropped file once, best effort: CLOSE on its RDMA channel and on
/// the side channel, no reconnect.
pub(crate) fn close_once(client: &Client, r: &reconnect::Route) {
    let e = &r.engine;
    if let Err(e) = e.issue_close(r.fid).and_then(|x| e.wait(x)) {
        debug!(error = %e, "closing a dropped file (RDMA)");
    }
    if let Err(e) = client.0.side_once(|s| s.close(r.handle)) {
        debug!(error = %e, "closing a dropped file (side channel)");
    }
}

/// The limits of one request on a connection ([`File::request_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// The most one READ request returns.
    pub max_read: usize,
    /// The most one WRITE request carries.
    pub max_write: usize,
    /// The longest write sent as one fragmented message from registered
    /// memory ([`Batch::send_from_buffer`], [`Batch::write_message`]).
    pub max_write_message: usize,
    /// Staging buffers: the most staged requests (reads into plain memory)
    /// outstanding at once.
    pub stage_slots: usize,
}
