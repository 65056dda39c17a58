//! Receive (as Linux siw's `siw_qp_rx.c`): deframing the byte stream
//! (lwio-iwarp's `FpduReceiver`), validating each segment (`DdpRxState`),
//! placing its payload into registered memory, receive buffers or an
//! anonymous buffer, and completing messages.

use super::*;

impl Stage {
    fn avail(&self) -> usize {
        self.end - self.start
    }

    /// Read up to `limit` bytes after the staged ones. The buffer starts
    /// at [`STAGE_MIN`] (an idle connection's QP holds no more), grows to
    /// [`STAGE`] when a read fills it, and goes back to the small size once
    /// [`STAGE_QUIET`] reads in a row on an empty stage brought little.
    fn fill(&mut self, io: &mut dyn Io, limit: usize) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > STAGE_MIN && self.quiet >= STAGE_QUIET {
                self.buf = vec![0u8; STAGE_MIN].into_boxed_slice();
                self.quiet = 0;
            }
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            self.grow();
        }
        let room = (self.buf.len() - self.end).min(limit.max(1));
        // SAFETY: the range is inside our own boxed buffer; no reference to it
        // is live during the call.
        let n = unsafe { io.read(self.buf.as_mut_ptr().add(self.end), room)? };
        self.end += n;
        if n == room && self.end == self.buf.len() {
            self.grow();
            self.quiet = 0;
        } else if n < STAGE_MIN {
            self.quiet = self.quiet.saturating_add(1);
        } else {
            self.quiet = 0;
        }
        Ok(n)
    }

    /// Up to the full [`STAGE`], keeping the staged bytes.
    fn grow(&mut self) {
        if self.buf.len() >= STAGE {
            return;
        }
        let mut b = vec![0u8; STAGE].into_boxed_slice();
        let n = self.end - self.start;
        b[..n].copy_from_slice(&self.buf[self.start..self.end]);
        self.buf = b;
        self.start = 0;
        self.end = n;
    }
}

/// Place `src` at `dst` (registered memory, or an anonymous buffer): plain
/// copies, except the last whole 8-byte-aligned word inside the range,
/// which is one `AtomicU64` store with `Release` ordering, after the bytes
/// before it.
///
/// Soundness does not rest on the atomic store: the caller holds the write
/// fence of the destination's regions, which every other access to their
/// bytes from this process takes too (`soft::mem`, "The region fence is
/// the region's reader-writer lock"), so nothing reads or writes these
/// bytes concurrently. The store is for the protocol: a status block the
/// peer RDMA-Writes with an 8-byte Write of its own is stored whole, and a
/// word whose bytes arrive in two pieces (TCP delivered the segment's
/// payload in two reads, placed under two holds of the fence) is not
/// placed by halves either: the receive path holds the first piece's part
/// of it back ([`HeldWord`]) and places the word whole once the next piece
/// completes it, so a poller (`MrSlice::load_u64`) never sees a status
/// block half new. A word in the middle of a longer piece is placed by
/// plain copies (a status block is an RDMA Write of its own). Bytes after
/// the word (fewer than 8) follow it.
///
/// # Safety
/// `dst..dst + src.len()` must be valid for writes, not overlap `src`, not
/// be covered by a Rust reference, and not be accessed by another thread
/// during the call (registered memory: the caller holds its regions' write
/// fences).
unsafe fn place_bytes(dst: *mut u8, src: &[u8]) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let n = src.len();
    let start = dst as usize;
    // The last 8-aligned address `w` with `start <= w` and `w + 8 <= end`.
    let word = (start + n)
        .checked_sub(8)
        .map(|w| w & !7)
        .filter(|&w| w >= start)
        .map(|w| w - start);
    match word {
        Some(o) => {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, o);
            let mut v = [0u8; 8];
            v.copy_from_slice(&src[o..o + 8]);
            // `dst + o` is 8-aligned and its 8 bytes are inside the range;
            // the value is the source bytes in memory order (native
            // endianness both ways).
            AtomicU64::from_ptr(dst.add(o).cast()).store(u64::from_ne_bytes(v), Ordering::Release);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(o + 8), dst.add(o + 8), n - o - 8);
        }
        None => std::ptr::copy_nonoverlapping(src.as_ptr(), dst, n),
    }
}

/// The bytes of a payload's last aligned word that arrived before the rest
/// of it, held back so that the word is placed whole by one atomic store
/// ([`place_bytes`]) when the segment's next bytes complete it, rather than
/// by halves that a poller of the word could see between the two reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeldWord {
    /// The word's address (8-aligned, in the current destination piece).
    addr: u64,
    bytes: [u8; 8],
    /// How many of `bytes` have arrived.
    len: usize,
}

/// Copy bytes into a scatter list at `off`.
///
/// # Safety
/// The pieces must describe valid, writable registered memory that no
/// other thread accesses during the call (the caller holds the regions'
/// write fences).
unsafe fn scatter(pieces: &[Piece], off: u64, data: &[u8]) {
    let mut v = Vec::new();
    map_pieces(pieces, off, data.len() as u64, &mut v);
    let mut at = 0usize;
    for p in v {
        std::ptr::copy_nonoverlapping(data.as_ptr().add(at), p.addr as *mut u8, p.len as usize);
        at += p.len as usize;
    }
}

/// The completion of a receive that a whole message filled: a Send of
/// `len` bytes (that invalidated `inv`), or an Immediate Data message
/// (`imm`; IB's `RECV_RDMA_WITH_IMM`, no bytes written into the receive).
fn recv_wc(wr_id: u64, qpn: u32, len: u64, inv: Option<u32>, imm: Option<u32>) -> Wc {
    let mut w = match imm {
        Some(_) => wc(wr_id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, qpn),
        None => wc(wr_id, WcStatus::Success, WcOpcode::Recv, qpn),
    };
    w.byte_len = if imm.is_some() { 0 } else { len as u32 };
    w.invalidated_rkey = inv;
    w.imm = imm;
    w
}

impl QpEngine {
    /// Deliver buffered (anonymous) messages to posted receives, in order.
    /// A message still arriving moves to a receive only between its
    /// segments; one with a segment half read waits for that segment's end
    /// (`finish_segment` calls this again).
    pub(super) fn drain_anon(&mut self) {
        while !self.anon.is_empty() {
            if self.anon_seg_open
                && self.anon.len() == 1
                && self.anon.front().is_some_and(|a| !a.complete)
            {
                break;
            }
            let Some(r) = self.take_recv() else {
                break;
            };
            let Some(a) = self.anon.pop_front() else {
                break;
            };
            self.stats.anon_bytes -= a.data.len() + ANON_OVERHEAD;
            if a.data.len() as u64 > r.len {
                let mut w = wc(r.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, self.p.qpn);
                w.byte_len = a.data.len() as u32;
                self.p.rcq.push(w, true);
                self.fatal(TermKind::DdpUntaggedMessageTooLong, false);
                return;
            }
            let keep = PlaceKeep::regions(&r._keep);
            let guard = keep.as_ref().map(|k| k.enter());
            if matches!(guard, Some(None)) {
                // A region of the receive was deregistered since the post.
                drop(guard);
                self.p.rcq.push(
                    wc(r.wr_id, WcStatus::LocProtErr, WcOpcode::Recv, self.p.qpn),
                    true,
                );
                self.fatal(TermKind::RdmapLocalCatastrophic, false);
                return;
            }
            // SAFETY: the receive's pieces were validated against
            // registrations with LOCAL_WRITE, still live and write-fenced
            // (the guard: no other access to their bytes runs meanwhile);
            // the source is our own heap buffer.
            unsafe { scatter(&r.pieces, 0, &a.data) };
            drop(guard);
            if a.complete {
                let w = recv_wc(r.wr_id, self.p.qpn, a.data.len() as u64, a.inv, a.imm);
                self.p.rcq.push(w, a.solicited);
            } else {
                // The message still arriving continues into this receive.
                self.cur_recv = Some(r);
                if let Some(c) = self.cur_send.as_mut() {
                    c.target = Target::Recv;
                }
                break;
            }
        }
    }

    /// Process incoming bytes until the stream is drained (WouldBlock),
    /// paused by flow control, or closed. Returns segments processed.
    pub fn rx_process(&mut self, io: &mut dyn Io) -> io::Result<usize> {
        let mut segs = 0;
        self.rx_more = false;
        if self.p.srq.is_some() {
            // Receives may have been posted to the SRQ since the last drive
            // (which is why the SRQ scheduled this QP).
            self.drain_anon();
        }
        if self.peer_closed {
            return Ok(0);
        }
        loop {
            if segs >= self.p.rx_budget {
                // Fairness: let other QPs run. The socket may still hold
                // data and no new edge will say so: the driver must come
                // back (see `rx_more`).
                self.rx_more = true;
                return Ok(segs);
            }
            let r = self.rx_step(io);
            match r {
                Ok(true) => segs += 1,
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(segs),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    self.peer_closed = true;
                    self.on_eof();
                    return Ok(segs);
                }
                Err(e) => {
                    self.peer_closed = true;
                    tracing::debug!(qpn = self.p.qpn, error = %e, "receive error");
                    self.on_eof();
                    return Ok(segs);
                }
            }
            if self.rx == RxState::Place {
                // Paused (indicate window full): leave the socket unread.
                return Ok(segs);
            }
        }
    }

    fn on_eof(&mut self) {
        self.enter_error(Some((WcStatus::RetryExcErr, 0)).filter(|_| false));
        self.rx = RxState::Discard;
        if self.shut == Shut::None {
            self.shut = Shut::Now;
        }
    }

    fn eof() -> io::Error {
        io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed")
    }

    /// One step; Ok(true) when a segment completed.
    fn rx_step(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        match self.rx {
            RxState::Discard => {
                self.stage.start = self.stage.end;
                if self.stage.fill(io, STAGE)? == 0 {
                    return Err(Self::eof());
                }
                self.stage.start = self.stage.end;
                Ok(false)
            }
            RxState::Place => {
                self.place();
                Ok(false)
            }
            RxState::Payload => {
                if self.fpdu.payload_remaining() > 0 && self.direct_read(io)? {
                    return Ok(false);
                }
                self.rx_frame(io)
            }
            RxState::Frame => self.rx_frame(io),
        }
    }

    /// The current destination piece, skipping filled ones.
    fn dest_piece(&mut self) -> Option<Piece> {
        while let Some(p) = self.dest.get(self.dest_idx) {
            if self.dest_off < p.len {
                return Some(*p);
            }
            self.dest_idx += 1;
            self.dest_off = 0;
        }
        None
    }

    /// Payload straight from the socket into its target (CRC off, nothing
    /// staged, a large enough piece). Returns false when the bytes must go
    /// through the stage instead.
    fn direct_read(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        if self.stage.all_staged
            || self.stage.avail() > 0
            || self.held.is_some()
            || !DIRECT_PLACEMENT.load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(false);
        }
        let Some(p) = self.dest_piece() else {
            return Ok(false);
        };
        let left = (p.len - self.dest_off).min(u64::from(self.fpdu.payload_remaining())) as usize;
        let min = if self.stage.small {
            SMALL_DIRECT_MIN
        } else {
            DIRECT_MIN
        };
        if p.addr == 0 || left < min {
            return Ok(false);
        }
        // Registered memory is written only while its key (or receive) is
        // live, under the regions' fences for the length of the read
        // (`PlaceKeep::enter`: revocation and every other access to those
        // bytes wait); an anonymous buffer has no keep.
        let keep = self.dest_keep.take();
        let r = match keep.as_ref().map(|k| k.enter()) {
            Some(None) => None,
            g => {
                let _g = g.flatten();
                // SAFETY: `p` lies inside a registration validated for this
                // segment (tagged: STag/PD/rights/bounds checked; receive:
                // lkey with LOCAL_WRITE), still live and write-fenced by the
                // guard held, so no other thread accesses these bytes during
                // the read; or in our own anonymous heap buffer, kept in
                // place while `anon_seg_open`. The kernel writes it on this
                // thread's behalf; no Rust reference to it is formed, and the
                // bytes are not read back (no CRC).
                Some(unsafe { io.read((p.addr + self.dest_off) as *mut u8, left) })
            }
        };
        self.dest_keep = keep;
        let Some(r) = r else {
            self.placement_revoked();
            return Ok(true);
        };
        let n = r?;
        if n == 0 {
            return Err(Self::eof());
        }
        self.stats.direct += n as u64;
        self.dest_off += n as u64;
        if let Err(e) = self.fpdu.advance_len(n as u32) {
            self.fatal_rx(e);
        }
        Ok(true)
    }

    /// Feed staged bytes to the deframer and act on what it finds.
    fn rx_frame(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        if self.stage.avail() == 0 {
            let limit = if self.stage.all_staged
                || self.stage.small
                || !DIRECT_PLACEMENT.load(std::sync::atomic::Ordering::Relaxed)
            {
                STAGE
            } else if self.rx == RxState::Payload {
                (self.fpdu.payload_remaining() as usize).max(HDR_FILL)
            } else {
                HDR_FILL
            };
            if self.stage.fill(io, limit)? == 0 {
                return Err(Self::eof());
            }
        }
        let input = &self.stage.buf[self.stage.start..self.stage.end];
        let (used, ev) = match self.fpdu.poll(input) {
            Ok(r) => r,
            Err(e) => {
                self.fatal_rx(e);
                return Ok(false);
            }
        };
        match ev {
            None => {
                self.stage.start += used;
                Ok(false)
            }
            Some(FpduEvent::Payload { data, .. }) => {
                let mut data = data;
                // As in `direct_read`: the copies run under the write fences
                // of the destination's regions, and only while it is live.
                let keep = self.dest_keep.take();
                let guard = keep.as_ref().map(|k| k.enter());
                let revoked = matches!(guard, Some(None));
                while !revoked && !data.is_empty() {
                    let Some(p) = self.dest.get(self.dest_idx).copied() else {
                        break;
                    };
                    let mut n = ((p.len - self.dest_off) as usize).min(data.len());
                    if let Some(h) = &mut self.held {
                        // The rest of a held word: it lies in this piece,
                        // where the held bytes ended.
                        n = n.min(8 - h.len);
                        h.bytes[h.len..h.len + n].copy_from_slice(&data[..n]);
                        h.len += n;
                        if h.len == 8 {
                            // SAFETY: the word lies inside this validated,
                            // live destination piece (checked when it was
                            // held back), write-fenced by `guard` (no other
                            // thread accesses it meanwhile) and covered by
                            // no Rust reference; the source is our own array.
                            unsafe { place_bytes(h.addr as *mut u8, &h.bytes) };
                            self.held = None;
                        }
                        self.stats.copied += n as u64;
                    } else if p.addr != 0 && n > 0 {
                        let start = p.addr + self.dest_off;
                        let end = start + n as u64;
                        let word = end & !7;
                        // Hold back the start of the last aligned word when
                        // this piece covers it from its start, the word
                        // lies in the piece, and the segment's payload
                        // still to come completes it.
                        let hold = n == data.len()
                            && end != word
                            && word >= start
                            && word + 8 <= p.addr + p.len
                            && u64::from(self.fpdu.payload_remaining()) >= word + 8 - end;
                        let now = if hold { (word - start) as usize } else { n };
                        // SAFETY: as in `direct_read`: a validated, live
                        // destination, write-fenced by `guard`, that no Rust
                        // reference covers (or our anonymous buffer); the
                        // source is our own stage.
                        unsafe { place_bytes(start as *mut u8, &data[..now]) };
                        if hold {
                            let mut h = HeldWord {
                                addr: word,
                                bytes: [0; 8],
                                len: n - now,
                            };
                            h.bytes[..h.len].copy_from_slice(&data[now..n]);
                            self.held = Some(h);
                        }
                        self.stats.copied += n as u64;
                    }
                    data = &data[n..];
                    self.dest_off += n as u64;
                    if self.dest_off == p.len {
                        self.dest_idx += 1;
                        self.dest_off = 0;
                    }
                }
                drop(guard);
                self.dest_keep = keep;
                if revoked {
                    self.placement_revoked();
                    return Ok(false);
                }
                self.stage.start += used;
                Ok(false)
            }
            Some(FpduEvent::Header {
                header,
                ulpdu_len,
                payload_len,
            }) => {
                self.stage.start += used;
                self.on_header(header, ulpdu_len, payload_len);
                Ok(false)
            }
            Some(FpduEvent::End) => {
                self.stage.start += used;
                if let Some(seg) = self.cur.take() {
                    self.ddp.commit(&seg);
                }
                self.finish_segment();
                if self.rx != RxState::Discard {
                    self.rx = RxState::Frame;
                }
                Ok(true)
            }
        }
    }

    /// The key of the segment being placed was revoked (deregistered,
    /// invalidated, re-bound) while its payload was arriving: nothing more
    /// is written, and the stream ends as for a segment that named a dead
    /// key from the start.
    /// A receive's region deregistered while it was posted is a local
    /// error: the stream ends without writing into it.
    fn placement_revoked(&mut self) {
        self.dest_keep = None;
        self.held = None;
        if self.seg.tagged {
            self.fatal(TermKind::DdpTaggedInvalidStag, true);
        } else {
            self.fatal(TermKind::RdmapLocalCatastrophic, false);
        }
    }

    /// Where a new message on the Send queue goes: the next posted
    /// receive, unless earlier messages wait for one (they keep their
    /// order) or none is posted — then it is held anonymously (seed 003).
    fn new_message_target(&mut self) -> Target {
        if !self.anon.is_empty() {
            return Target::Anon;
        }
        match self.take_recv() {
            Some(r) => {
                self.cur_recv = Some(r);
                Target::Recv
            }
            None => Target::Anon,
        }
    }

    /// Account `bytes` more of anonymously held messages (a new one, empty,
    /// queued first if `new`), or, past the indicate window, pause reading
    /// the stream (`false`: the segment is placed later).
    fn hold_anon(&mut self, bytes: usize, new: bool) -> bool {
        if self.stats.anon_bytes + bytes > self.p.indicate_window {
            self.stats.paused += 1;
            self.rx = RxState::Place;
            return false;
        }
        if new {
            self.anon.push_back(AnonMsg {
                data: Vec::new(),
                complete: false,
                inv: None,
                solicited: false,
                imm: None,
            });
        }
        self.stats.anon_bytes += bytes;
        self.stats.anon_peak = self.stats.anon_peak.max(self.stats.anon_bytes);
        self.anon_seg_open = true;
        true
    }

    /// A segment header: validate it against the stream (lwio-iwarp's
    /// DDP/RDMAP rules), then find where its payload goes.
    fn on_header(&mut self, h: SegmentHeader, ulpdu_len: u16, paylen: u32) {
        let seg = match self.ddp.validate(&h, paylen) {
            Ok(seg) => seg,
            Err(e) => return self.fatal(e, true),
        };
        let mut s = Seg {
            tagged: false,
            last: h.last,
            opcode: h.opcode,
            paylen: paylen as usize,
            rr: h.read_request,
            ..Seg::default()
        };
        match h.ddp {
            DdpKind::Tagged { stag, to } => {
                s.tagged = true;
                s.stag = stag;
                s.to = to;
            }
            DdpKind::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                s.inv = rsvd_ulp;
                s.qn = qn;
                s.msn = msn;
                s.mo = mo;
            }
        }
        self.stage.small = (ulpdu_len as usize) < SMALL_SEG;
        self.seg = s;
        self.cur = Some(seg);
        self.rx = RxState::Place;
        self.place();
    }

    /// Decide where the current segment's payload goes (validating it), or
    /// stay paused.
    fn place(&mut self) {
        self.dest.clear();
        self.dest_idx = 0;
        self.dest_off = 0;
        self.dest_keep = None;
        self.held = None;
        self.anon_seg_open = false;
        let s = self.seg;
        let n = s.paylen as u64;
        if self.state == QpState::Error {
            self.dest.push(Piece { addr: 0, len: n });
            self.rx = RxState::Payload;
            return;
        }
        if s.tagged {
            match s.opcode {
                Opcode::Write => {
                    if n > 0 {
                        let cont = self
                            .tagged
                            .as_ref()
                            .filter(|c| c.stag == s.stag && c.next_to == s.to);
                        let addr = match cont {
                            Some(c) => {
                                if s.to.checked_add(n).is_none_or(|e| e > c.end) {
                                    return self.fatal(TermKind::DdpTaggedBaseBounds, true);
                                }
                                if !c.keep.live() {
                                    return self.fatal(TermKind::DdpTaggedInvalidStag, true);
                                }
                                s.to
                            }
                            None => match self.p.table.remote(
                                s.stag,
                                s.to,
                                n,
                                Access::REMOTE_WRITE,
                                self.p.pd,
                                self.p.qpn,
                                false,
                            ) {
                                Ok(r) => {
                                    // The message's validated range: for a
                                    // multi-segment write, later segments must
                                    // stay inside the region/window range.
                                    self.tagged = Some(TaggedCtx {
                                        stag: s.stag,
                                        next_to: s.to,
                                        end: r.end,
                                        keep: PlaceKeep::new(r.mr, r.mw),
                                    });
                                    r.ptr
                                }
                                Err(c) => return self.fatal(c, true),
                            },
                        };
                        if let Some(c) = self.tagged.as_mut() {
                            c.next_to = s.to + n;
                            self.dest_keep = Some(c.keep.clone());
                        }
                        self.dest.push(Piece { addr, len: n });
                    }
                }
                Opcode::ReadResponse => {
                    let Some(o) = self.orq.front() else {
                        return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true);
                    };
                    if n > 0 {
                        if s.stag != o.sink_stag {
                            return self.fatal(TermKind::DdpTaggedInvalidStag, true);
                        }
                        if s.to != o.sink_to + o.got || o.got + n > o.len {
                            return self.fatal(TermKind::DdpTaggedBaseBounds, true);
                        }
                        // The sink's registration (the Read WR's one SGE):
                        // deregistered since the post, nothing is placed.
                        let keep = self
                            .sq_index(o.seq)
                            .and_then(|i| self.sq[i].keep.first().cloned())
                            .map(|mr| PlaceKeep::new(mr, None));
                        match keep {
                            Some(k) if k.live() => self.dest_keep = Some(k),
                            _ => return self.fatal(TermKind::DdpTaggedInvalidStag, true),
                        }
                        self.dest.push(Piece { addr: s.to, len: n });
                    }
                }
                _ => return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true),
            }
        } else {
            match (s.qn, s.opcode) {
                (
                    QN_SEND,
                    Opcode::Send
                    | Opcode::SendInvalidate
                    | Opcode::SendSe
                    | Opcode::SendSeInvalidate,
                ) => {
                    // MSN and message offset were checked by `DdpRxState`.
                    let target = match self.cur_send.as_ref().map(|c| c.target) {
                        Some(t) => t,
                        None => self.new_message_target(),
                    };
                    match target {
                        Target::Recv => {
                            let Some(r) = self.cur_recv.as_ref() else {
                                // Not reached: a message whose target is a
                                // receive holds it until its last segment.
                                return self.fatal(TermKind::RdmapOpUnspecified, true);
                            };
                            if s.mo as u64 + n > r.len {
                                let Some(r) = self.cur_recv.take() else {
                                    return self.fatal(TermKind::RdmapOpUnspecified, true);
                                };
                                let mut w =
                                    wc(r.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, self.p.qpn);
                                w.byte_len = (s.mo as u64 + n) as u32;
                                self.p.rcq.push(w, true);
                                return self.fatal(TermKind::DdpUntaggedMessageTooLong, true);
                            }
                            let mut v = std::mem::take(&mut self.dest);
                            map_pieces(&r.pieces, s.mo as u64, n, &mut v);
                            self.dest = v;
                            // The receive's regions: placed under their
                            // fences, and not at all once one of them is
                            // deregistered (the memory may be gone).
                            self.dest_keep = PlaceKeep::regions(&r._keep);
                        }
                        Target::Anon => {
                            let extra = if self.cur_send.is_none() {
                                ANON_OVERHEAD
                            } else {
                                0
                            };
                            let first = self.cur_send.is_none();
                            if !self.hold_anon(n as usize + extra, first) {
                                return;
                            }
                            let a = self.anon.back_mut().expect("anon message");
                            let old = a.data.len();
                            a.data.resize(old + n as usize, 0);
                            if n > 0 {
                                self.dest.push(Piece {
                                    addr: a.data.as_mut_ptr() as u64 + old as u64,
                                    len: n,
                                });
                            }
                        }
                    }
                    if self.cur_send.is_none() {
                        self.cur_send = Some(CurSend { mo: 0, target });
                    }
                }
                (QN_SEND, Opcode::ImmediateData | Opcode::ImmediateDataSe) => {
                    // RFC 7306 Immediate Data: one segment of 8 bytes
                    // (checked by `DdpRxState`), read into `imm_in`. It
                    // consumes the next receive, in order with the Sends
                    // around it, without writing into the receive's memory
                    // (`finish_segment` completes it as RecvRdmaWithImm);
                    // with no receive posted it waits among the anonymous
                    // messages like a Send (seed 003), for its overhead.
                    let target = self.new_message_target();
                    if target == Target::Anon && !self.hold_anon(ANON_OVERHEAD, true) {
                        return;
                    }
                    self.dest.push(Piece {
                        addr: self.imm_in.as_mut_ptr() as u64,
                        len: n,
                    });
                    self.cur_send = Some(CurSend { mo: 0, target });
                }
                (QN_READ_REQUEST, Opcode::ReadRequest) => {
                    if self.irq.len() >= self.p.ird.max(1) as usize {
                        return self.fatal(TermKind::MpaInsufficientIrd, true);
                    }
                    let Some(rr) = s.rr else {
                        return self.fatal(TermKind::RdmapOpUnspecified, true);
                    };
                    let mr = if rr.size > 0 {
                        match self.p.table.remote(
                            rr.src_stag,
                            rr.src_to,
                            rr.size as u64,
                            Access::REMOTE_READ,
                            self.p.pd,
                            self.p.qpn,
                            true,
                        ) {
                            Ok(r) => Some(r.mr),
                            Err(c) => return self.fatal(c, true),
                        }
                    } else {
                        None
                    };
                    self.irq.push_back(IrqEntry {
                        mr,
                        src: rr.src_to,
                        len: rr.size as u64,
                        sent: 0,
                        sink_stag: rr.sink_stag,
                        sink_to: rr.sink_to,
                        started: false,
                    });
                }
                (QN_TERMINATE, Opcode::Terminate) => {
                    let k = (n as usize).min(TERM_MAX);
                    self.ctl.fill(0);
                    if k > 0 {
                        self.dest.push(Piece {
                            addr: self.ctl.as_mut_ptr() as u64,
                            len: k as u64,
                        });
                    }
                    if (n as usize) > k {
                        self.dest.push(Piece {
                            addr: 0,
                            len: n - k as u64,
                        });
                    }
                }
                (q, _) if q > QN_TERMINATE => {
                    return self.fatal(TermKind::DdpUntaggedInvalidQn, true)
                }
                _ => return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true),
            }
        }
        self.rx = RxState::Payload;
    }

    fn finish_segment(&mut self) {
        self.anon_seg_open = false;
        if self.state == QpState::Error {
            return;
        }
        let s = self.seg;
        let n = s.paylen as u64;
        if s.tagged {
            match s.opcode {
                Opcode::Write if s.last => self.tagged = None,
                Opcode::ReadResponse => {
                    let Some(o) = self.orq.front_mut() else {
                        return;
                    };
                    o.got += n;
                    if s.last {
                        let o = self.orq.pop_front().expect("non-empty");
                        if o.got != o.len {
                            return self.fatal(TermKind::DdpTaggedBaseBounds, false);
                        }
                        if let Some(i) = self.sq_index(o.seq) {
                            let w = &mut self.sq[i];
                            w.done = true;
                            w.byte_len = o.len as u32;
                        }
                        self.complete_sq();
                    }
                }
                _ => {}
            }
            return;
        }
        match s.qn {
            QN_SEND => {
                let Some(c) = self.cur_send.as_mut() else {
                    return;
                };
                c.mo += n;
                if !s.last {
                    if c.target == Target::Anon {
                        // A receive posted while this segment was being
                        // read takes the message from here on.
                        self.drain_anon();
                    }
                    return;
                }
                let total = c.mo;
                let target = c.target;
                self.cur_send = None;
                let inv = if s.opcode.is_invalidate() {
                    if self
                        .p
                        .table
                        .invalidate(s.inv, self.p.pd, Some(self.p.qpn))
                        .is_err()
                    {
                        return self.fatal(TermKind::RdmapOpCannotInvalidate, false);
                    }
                    Some(s.inv)
                } else {
                    None
                };
                let solicited = s.opcode.is_solicited();
                // Immediate Data (RFC 7306): the value is the first 4 of
                // its 8 bytes, big-endian; nothing was written into the
                // receive.
                let imm = s.opcode.is_immediate().then(|| {
                    let [a, b, c, d, ..] = *self.imm_in;
                    u32::from_be_bytes([a, b, c, d])
                });
                match target {
                    Target::Recv => {
                        let Some(r) = self.cur_recv.take() else {
                            // Not reached (see `place`).
                            return self.fatal(TermKind::RdmapOpUnspecified, false);
                        };
                        self.p
                            .rcq
                            .push(recv_wc(r.wr_id, self.p.qpn, total, inv, imm), solicited);
                    }
                    Target::Anon => {
                        if let Some(a) = self.anon.back_mut() {
                            a.complete = true;
                            a.inv = inv;
                            a.solicited = solicited;
                            a.imm = imm;
                        }
                        self.drain_anon();
                    }
                }
            }
            QN_TERMINATE => {
                let code = rdmap::terminate_error(&self.ctl[..])
                    .unwrap_or(TermKind::RdmapOpUnspecified.into());
                tracing::debug!(qpn = self.p.qpn, ?code, "terminate received");
                self.stats.term_recv += 1;
                self.stats.last_term = code.vendor_err();
                let st = if code.is_protection() {
                    WcStatus::RemAccessErr
                } else if code.kind() == Some(TermKind::DdpUntaggedMessageTooLong) {
                    WcStatus::RemInvReqErr
                } else {
                    WcStatus::RemOpErr
                };
                self.enter_error(Some((st, code.vendor_err())));
                self.rx = RxState::Discard;
                if self.shut == Shut::None {
                    self.shut = Shut::Now;
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::place_bytes;

    /// `place_bytes` writes exactly the source bytes, at every alignment and
    /// length around a word (Miri-runnable: the atomic store is checked for
    /// alignment and bounds).
    #[test]
    fn place_bytes_copies_every_byte() {
        let src: Vec<u8> = (1..=40u8).collect();
        for off in 0..16 {
            for n in 0..=24 {
                let mut buf = [0u64; 8];
                let base = buf.as_mut_ptr().cast::<u8>();
                // SAFETY: `off + n <= 40 < 64`: inside our own array, which no
                // reference covers during the call.
                unsafe { place_bytes(base.add(off), &src[..n]) };
                // SAFETY: the array is initialised; the call has returned.
                let got = unsafe { std::slice::from_raw_parts(base, 64) };
                assert!(got[..off].iter().all(|&b| b == 0), "off {off} n {n}");
                assert_eq!(&got[off..off + n], &src[..n], "off {off} n {n}");
                assert!(got[off + n..].iter().all(|&b| b == 0), "off {off} n {n}");
            }
        }
    }
}
