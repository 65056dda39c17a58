//! [`Batch`]: the requests of one call (a read or write split into parts
//! of what one request carries), the one multi-request primitive of the
//! client. It owns each part (request, stage, offset and length in the
//! call), the caller memory the parts land in or send from and its fencing,
//! and the rule of a short part; callers issue parts and reap them in
//! order, blocking ([`Batch::reap`]) or not ([`Batch::try_reap`],
//! [`Batch::poll`]). The blocking `File`, `AsyncFile`, the C API's batch
//! calls, the preload's AIO and `lwio bench` all keep their requests here,
//! and the engine (`ClientConn`) keeps each request once beside it.

use std::collections::VecDeque;
use std::sync::Arc;

use lwio_proto::client::ReqId;
use lwio_proto::status::{NtStatus, STATUS_SUCCESS};

use crate::engine::{Engine, Stage, UserDst, UserSrc};
use crate::{Error, Result};

/// What a part that completes successfully but short of its length means
/// for its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Short {
    /// It ends the call (a read that reached the end of the file): its
    /// bytes count, those of the parts after it do not.
    Ends,
    /// It fails the call with "short write" (a blocking write).
    Fails,
    /// Its bytes count and the call goes on.
    Counts,
}

/// The first thing that ended a call before all its parts counted.
#[derive(Debug)]
pub enum End {
    /// A part completed short of its length ([`Short::Ends`]).
    Short,
    /// A part completed with this status (STATUS_END_OF_FILE included).
    Status(NtStatus),
    /// A part could not be issued, or its completion never came (the
    /// connection was lost, the request timed out), or it was short
    /// ([`Short::Fails`]).
    Failed(Error),
}

/// One request of the call.
struct Part {
    req: ReqId,
    /// Where a read's data waits to be copied out (None: a write, or a
    /// read into caller memory).
    stage: Option<Stage>,
    /// Offset in the call, and length.
    at: usize,
    len: usize,
    /// Its completion, once seen.
    done: Option<Result<(u32, NtStatus)>>,
}

/// The requests of one call on one connection (see the module). Dropped
/// with parts outstanding, it abandons them (the engine frees their
/// staging buffers when they complete); dropped or finished, it fences the
/// caller memory its parts land in or send from, so no remote access to it
/// outlives the batch.
pub struct Batch {
    engine: Arc<Engine>,
    fid: u16,
    /// The call's file offset (a part's is this plus its `at`).
    offset: u64,
    short: Short,
    parts: VecDeque<Part>,
    /// Bytes of the call issued so far: the next part's `at`.
    issued: usize,
    /// Caller memory reads land in (the part at `at` in its bytes `at..`).
    dst: Option<UserDst>,
    /// Registered caller memory writes send from (fragmented messages),
    /// and whether its sends are fenced.
    src: Option<UserSrc>,
    fence_src: bool,
    /// Landed parts whose data is left in their stages (stage, at, bytes).
    kept: Vec<(Stage, usize, usize)>,
    /// Bytes that count so far, and what ended the call.
    total: usize,
    end: Option<End>,
    /// A part lost with its connection is the caller's to run again
    /// ([`Landing::lost`]) instead of an end of the call.
    replay: bool,
}

/// A handle on the connection of a [`Batch`]: to post the request
/// messages of several batches once they are all issued.
#[derive(Clone)]
pub struct Connection(Arc<Engine>);

impl Connection {
    /// Post the request messages issued and not yet posted.
    pub fn flush(&self) {
        self.0.flush();
    }
}

impl PartialEq for Connection {
    fn eq(&self, other: &Connection) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A reaped part: its data (if it counts) to copy where the caller wants
/// it. Dropped without a copy, its staging buffer is given back.
pub struct Landing<'a> {
    batch: &'a mut Batch,
    stage: Option<Stage>,
    at: usize,
    n: usize,
    /// The part's length.
    part_len: usize,
    lost: bool,
}

impl Landing<'_> {
    /// Offset of the part in its call.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Bytes of the part that count for the call (0 when none do).
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The part's length (what it asked for).
    pub fn part_len(&self) -> usize {
        self.part_len
    }

    /// The part was lost with its connection (not issued, or never
    /// answered) while nothing had ended the call, in a batch that runs
    /// such parts again ([`Batch::replay_lost`]): the caller runs it again
    /// and counts it with [`Batch::replayed`].
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// [`Landing::copy_to`] at the part's place in the call's buffer at
    /// `call`.
    ///
    /// # Safety
    /// `call` must point to the call's buffer, valid for writes of every
    /// byte the batch's parts cover (so of `at..at + len`), with no Rust
    /// reference over those bytes and nothing else reading or writing them
    /// until this returns.
    pub unsafe fn copy_into_raw(self, call: *mut u8) {
        if self.stage.is_some() {
            // SAFETY: `at + n` is within the part, so within the bytes the
            // caller vouches for; nothing else accesses them meanwhile (the
            // caller's contract), and the peer does not either: a part with
            // a stage was placed in the engine's staging memory, never in
            // the caller's. The slice lives only for this copy.
            let dst = unsafe { std::slice::from_raw_parts_mut(call.add(self.at), self.n) };
            self.copy_to(dst);
        }
    }

    /// Copy the part's staged bytes to `dst` (exactly [`Landing::len`]
    /// bytes) and give the staging buffer back. Nothing to copy for a part
    /// that landed in caller memory, a write, or one that does not count.
    pub fn copy_to(mut self, dst: &mut [u8]) {
        if let Some(s) = self.stage.take() {
            let k = dst.len().min(self.n);
            self.batch.engine.finish_stage(s, &mut dst[..k]);
        }
    }

    /// [`Landing::copy_to`] at the part's place in the call's buffer
    /// (`call[at..at + len]`).
    pub fn copy_into(self, call: &mut [u8]) {
        let (at, n) = (self.at, self.n);
        if self.stage.is_some() {
            self.copy_to(&mut call[at..at + n]);
        }
    }

    /// Leave the bytes in their staging buffer, with the batch, for
    /// [`Batch::copy_kept`] (or given back when the batch goes).
    pub fn keep(mut self) {
        if let Some(s) = self.stage.take() {
            self.batch.kept.push((s, self.at, self.n));
        }
    }
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.stage.take() {
            self.batch.engine.release_stage(s);
        }
    }
}

impl Batch {
    /// A call at `offset` of the file registered as `fid` on `engine`.
    pub(crate) fn new(engine: Arc<Engine>, fid: u16, offset: u64, short: Short) -> Batch {
        Batch {
            engine,
            fid,
            offset,
            short,
            parts: VecDeque::new(),
            issued: 0,
            dst: None,
            src: None,
            fence_src: false,
            kept: Vec::new(),
            total: 0,
            end: None,
            replay: false,
        }
    }

    /// Parts lost with their connection are the caller's to run again
    /// ([`Landing::lost`]), not an end of the call.
    pub fn replay_lost(&mut self) {
        self.replay = true;
    }

    /// Count a part that was run again ([`Landing::lost`]) after it gave
    /// `n` of its `len` bytes (short: the call ends there), or failed.
    pub fn replayed(&mut self, len: usize, r: Result<usize>) {
        match r {
            Ok(n) => {
                self.total += n;
                if n < len {
                    self.end.get_or_insert(End::Short);
                }
            }
            Err(e) => self.fail(e),
        }
    }

    /// The rest of the call (from [`Batch::issued`]) as one part lost with
    /// the connection before it was issued: the caller runs it again
    /// ([`Batch::replay_lost`]).
    pub fn lose_rest(&mut self, len: usize, why: Error) {
        self.parts.push_back(Part {
            req: 0,
            stage: None,
            at: self.issued,
            len,
            done: Some(Err(why)),
        });
        self.issued += len;
    }

    /// Post the request messages issued and not yet posted (a caller that
    /// reaps later, on another thread, has them on the wire now).
    pub fn flush(&self) {
        self.engine.flush();
    }

    /// The connection the batch's requests go on.
    pub fn connection(&self) -> Connection {
        Connection(self.engine.clone())
    }

    /// Largest READ per request on this connection (staged).
    pub fn max_read(&self) -> usize {
        self.engine.max_read()
    }

    /// Largest WRITE payload per request on this connection.
    pub fn max_write(&self) -> usize {
        self.engine.max_write()
    }

    /// Staging buffers free now for a read part of `len` bytes. A caller
    /// that reaps later (an asynchronous API) issues staged reads only
    /// while this is enough: staging buffers come back only when their
    /// reads are reaped.
    pub fn free_stages(&self, len: usize) -> usize {
        self.engine.free_stages(len)
    }

    /// Reads of the batch land straight in caller memory at `ptr`
    /// (covering the whole call) when it lies in a
    /// [`crate::RegisteredBuf`]-style cached registration or is long
    /// enough to register for the call; false (the batch stages) when it
    /// does not, or cannot be registered.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory the caller holds exclusively, with
    /// no Rust reference over it, allocated and untouched until the batch
    /// is finished or dropped (which fence every window over it).
    pub unsafe fn land_in_memory(&mut self, ptr: *mut u8, len: usize) -> bool {
        let per_call = len >= self.engine.register_threshold();
        // SAFETY: the caller's contract is `Engine::user_dst`'s (held
        // exclusively, no reference over it, allocated until the group is
        // fenced and the destination dropped): the batch keeps the
        // destination and fences its group when it is fenced, finished or
        // dropped, which the caller's contract puts before the memory goes.
        match unsafe { self.engine.user_dst(ptr, len, per_call) } {
            Ok(Some(d)) => {
                self.land_in(d);
                true
            }
            Ok(None) | Err(_) => false,
        }
    }

    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Reads land in `dst` (caller memory from `Engine::user_dst` or
    /// `Engine::slice_dst`, covering the whole call), fenced when the batch
    /// is finished or dropped.
    pub(crate) fn land_in(&mut self, dst: UserDst) {
        self.dst = Some(dst);
    }

    /// Whether reads land in caller memory.
    pub(crate) fn lands_in_caller(&self) -> bool {
        self.dst.is_some()
    }

    /// Fragmented writes send from `src` (registered caller memory holding
    /// the whole call's data), fenced when the batch is finished or
    /// dropped if `fence` (a source registered for the call, whose memory
    /// the caller frees after it: `Engine::write_source`'s contract). A
    /// source from the registration cache (`per_call` false) keeps its
    /// memory alive itself and needs no fence.
    pub fn send_from(&mut self, src: UserSrc, fence: bool) {
        self.src = Some(src);
        self.fence_src = fence;
    }

    /// Fragmented writes of this batch send from `buf` through its cached
    /// registration on this batch's connection (no copy; the registration
    /// keeps the memory alive, so nothing to fence). False when `buf` is
    /// not registered there (its writes are then copied).
    pub fn send_from_buffer(&mut self, buf: &crate::RegisteredBuf) -> Result<bool> {
        // SAFETY: without `per_call` only the buffer's cached registration
        // is used, which keeps its memory alive whatever becomes of the
        // borrow (`Engine::write_source`'s contract).
        match unsafe { self.engine.write_source(buf, false) }? {
            Some(src) => {
                self.send_from(src, false);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Whether writes send from registered caller memory.
    pub(crate) fn sends_from_caller(&self) -> bool {
        self.src.is_some()
    }

    /// Parts issued and not reaped yet.
    pub fn outstanding(&self) -> usize {
        self.parts.len()
    }

    /// Bytes of the call issued so far (the next part starts here).
    pub fn issued(&self) -> usize {
        self.issued
    }

    /// Whether something ended the call (no more parts should be issued).
    pub fn ended(&self) -> bool {
        self.end.is_some()
    }

    /// Bytes that count so far.
    pub fn total(&self) -> usize {
        self.total
    }

    /// End the call with `err` (unless something ended it already): a
    /// part that could not be issued.
    pub fn fail(&mut self, err: Error) {
        self.end.get_or_insert(End::Failed(err));
    }

    fn push(&mut self, req: ReqId, stage: Stage, len: usize) {
        let stage = match stage {
            Stage::User => None,
            s => Some(s),
        };
        self.parts.push_back(Part {
            req,
            stage,
            at: self.issued,
            len,
            done: None,
        });
        self.issued += len;
    }

    fn at(&self) -> u64 {
        self.offset + self.issued as u64
    }

    /// Issue the next `len` bytes as a READ (a VEC_READ of `vec_page`
    /// pages), waiting for a credit and a staging buffer.
    pub fn read(&mut self, len: usize, vec_page: Option<u16>) -> Result<()> {
        let dst = self.dst.as_ref().map(|d| (d, self.issued));
        let (req, stage) = self
            .engine
            .issue_read_to(self.fid, self.at(), len, vec_page, dst)?;
        self.push(req, stage, len);
        Ok(())
    }

    /// [`Batch::read`] (staged) only if a credit and a staging buffer are
    /// free now: `Ok(false)` if not. Posted at once.
    pub fn try_read(&mut self, len: usize) -> Result<bool> {
        match self.engine.try_issue_read(self.fid, self.at(), len)? {
            Some((req, stage)) => {
                self.push(req, stage, len);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Issue `data` as the next part, a WRITE (copied into a send slot).
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let req = self.engine.issue_write(self.fid, self.at(), data)?;
        self.push(req, Stage::User, data.len());
        Ok(())
    }

    /// [`Batch::write`] only if a credit and a send slot are free now:
    /// `Ok(false)` if not. Posted at once.
    pub fn try_write(&mut self, data: &[u8]) -> Result<bool> {
        match self.engine.try_issue_write(self.fid, self.at(), data)? {
            Some(req) => {
                self.push(req, Stage::User, data.len());
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Issue `data` as the next part, a VEC_WRITE of `page`-byte pages.
    pub fn vec_write(&mut self, page: u16, data: &[u8]) -> Result<()> {
        let len = u32::try_from(data.len())
            .map_err(|_| Error::InvalidArgument("write larger than 4 GiB".into()))?;
        let req = self
            .engine
            .issue_vec_write(self.fid, self.at(), page, len, data, false)?;
        self.push(req, Stage::User, data.len());
        Ok(())
    }

    /// Issue `data` as the next part, one fragmented message (WRITE, or
    /// VEC_WRITE of `vec_page` pages): from the batch's registered source
    /// at this part's place when it has one (no copy), else copied.
    pub fn write_message(&mut self, data: &[u8], vec_page: Option<u16>) -> Result<()> {
        let sub = self.src.as_ref().map(|u| u.at(self.issued));
        let req =
            self.engine
                .issue_write_message(self.fid, self.at(), data, vec_page, sub.as_ref())?;
        self.push(req, Stage::User, data.len());
        Ok(())
    }

    /// Wait for the oldest part and count it; `None` when none is
    /// outstanding.
    pub fn reap(&mut self) -> Option<Landing<'_>> {
        let p = self.parts.front_mut()?;
        if p.done.is_none() {
            p.done = Some(self.engine.wait(p.req));
        }
        self.take_front()
    }

    /// Whether the oldest part's completion has come, without blocking
    /// (`drive`: run the completion queue once first, as a waiter does).
    /// False when none is outstanding.
    pub fn poll_front(&mut self, drive: bool) -> bool {
        let Some(p) = self.parts.front_mut() else {
            return false;
        };
        if p.done.is_none() {
            match self.engine.try_wait(p.req, drive) {
                Ok(Some(r)) => p.done = Some(Ok(r)),
                Ok(None) => {}
                Err(e) => p.done = Some(Err(e)),
            }
        }
        p.done.is_some()
    }

    /// The oldest part, counted, if its completion has come (non-blocking;
    /// see [`Batch::poll_front`]).
    pub fn try_reap(&mut self, drive: bool) -> Option<Landing<'_>> {
        if !self.poll_front(drive) {
            return None;
        }
        self.take_front()
    }

    /// Look (without blocking) for the completions of every part not yet
    /// complete; true when all are. `drive` runs the completion queue for
    /// the first look only (and is cleared when it did).
    pub fn poll(&mut self, drive: &mut bool) -> bool {
        let mut all = true;
        for p in self.parts.iter_mut().filter(|p| p.done.is_none()) {
            let r = self.engine.try_wait(p.req, *drive);
            *drive = false;
            match r {
                Ok(Some(r)) => p.done = Some(Ok(r)),
                Ok(None) => all = false,
                Err(e) => p.done = Some(Err(e)),
            }
        }
        all
    }

    /// Wait for the completion of every part not yet complete.
    pub fn wait_all(&mut self) {
        for p in self.parts.iter_mut().filter(|p| p.done.is_none()) {
            p.done = Some(self.engine.wait(p.req));
        }
    }

    /// The oldest part gets `err` as its outcome: its waiter gives up (the
    /// engine frees its stage when, if ever, it completes).
    pub(crate) fn give_up_front(&mut self, err: Error) {
        if let Some(p) = self.parts.front_mut() {
            if p.done.is_none() {
                self.engine.abandon_req(p.req);
                p.stage = None;
                p.done = Some(Err(err));
            }
        }
    }

    /// The request of the oldest part.
    pub(crate) fn front_req(&self) -> Option<ReqId> {
        self.parts.front().map(|p| p.req)
    }

    /// Take the oldest part, complete, and count it: its bytes count while
    /// nothing has ended the call; a short part is [`Short`]'s to judge;
    /// an end of file, another status or an error ends the call (the first
    /// end is kept).
    fn take_front(&mut self) -> Option<Landing<'_>> {
        // Not complete yet: nothing to take.
        self.parts.front()?.done.as_ref()?;
        let mut p = self.parts.pop_front()?;
        let mut n = 0;
        match p.done.take()? {
            Ok((got, STATUS_SUCCESS)) => {
                let full = (got as usize).min(p.len);
                if self.end.is_none() {
                    match self.short {
                        Short::Ends => {
                            n = full;
                            self.total += n;
                            if n < p.len {
                                self.end = Some(End::Short);
                            }
                        }
                        Short::Counts => {
                            n = full;
                            self.total += n;
                        }
                        Short::Fails if got as usize == p.len => {
                            n = p.len;
                            self.total += n;
                        }
                        Short::Fails => {
                            self.end = Some(End::Failed(Error::Io(format!(
                                "short write: {got} of {} bytes",
                                p.len
                            ))));
                        }
                    }
                }
            }
            Ok((_, status)) => {
                self.end.get_or_insert(End::Status(status));
            }
            Err(e) => {
                // The engine abandoned it and frees its stage.
                p.stage = None;
                if self.replay && self.end.is_none() && matches!(e, Error::ConnectionLost(_)) {
                    return Some(Landing {
                        batch: self,
                        stage: None,
                        at: p.at,
                        n: 0,
                        part_len: p.len,
                        lost: true,
                    });
                }
                self.end.get_or_insert(End::Failed(e));
            }
        }
        let stage = p.stage.take();
        if n == 0 {
            // Nothing of it counts: its stage goes back now.
            if let Some(s) = stage {
                self.engine.release_stage(s);
            }
            return Some(Landing {
                batch: self,
                stage: None,
                at: p.at,
                n: 0,
                part_len: p.len,
                lost: false,
            });
        }
        Some(Landing {
            batch: self,
            stage,
            at: p.at,
            n,
            part_len: p.len,
            lost: false,
        })
    }

    /// Copy the data of the parts kept in their stages
    /// ([`Landing::keep`]) to their places in `call` and give the stages
    /// back.
    pub fn copy_kept(&mut self, call: &mut [u8]) {
        for (s, at, n) in self.kept.drain(..) {
            self.engine.finish_stage(s, &mut call[at..at + n]);
        }
    }

    /// Whether parts keep data in their stages.
    pub fn has_kept(&self) -> bool {
        !self.kept.is_empty()
    }

    /// Abandon the parts not complete yet (the engine frees their stages
    /// when they complete) and return their requests, for a caller that
    /// cancels them; completed, unreaped parts give their stages back.
    pub(crate) fn abandon_all(&mut self) -> Vec<ReqId> {
        let mut left = Vec::new();
        for p in self.parts.drain(..) {
            match p.done {
                None => {
                    self.engine.abandon_req(p.req);
                    left.push(p.req);
                }
                Some(Ok(_)) => {
                    if let Some(s) = p.stage {
                        self.engine.release_stage(s);
                    }
                }
                Some(Err(_)) => {}
            }
        }
        left
    }

    /// The call is over: fence its caller memory (no window over it, no
    /// send from it outlives this), and return the bytes that count and
    /// what ended it (`None`: every part counted in full).
    pub fn finish(mut self) -> (usize, Option<End>) {
        self.fence();
        (self.total, self.end.take())
    }

    /// The bytes that count so far and what ended the call (taken: a
    /// second call says `None`), leaving the batch (its kept stages, its
    /// fencing when dropped) as it is.
    pub fn take_end(&mut self) -> (usize, Option<End>) {
        (self.total, self.end.take())
    }

    /// Fence the caller memory of the batch now (every part must be
    /// complete): no window over it, no send from it, outlives this.
    /// Finishing or dropping the batch does it too.
    pub fn fence(&mut self) {
        if let Some(d) = self.dst.take() {
            self.engine.fence_group(d.group());
        }
        if let Some(u) = self.src.take() {
            if self.fence_src {
                self.engine.fence_sends(&u);
            }
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.abandon_all();
        for (s, ..) in self.kept.drain(..) {
            self.engine.release_stage(s);
        }
        self.fence();
    }
}
