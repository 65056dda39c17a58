//! Transmit (as Linux siw's `siw_qp_tx.c`): framing the send queue's work
//! requests, the answers to the peer's RDMA Reads and a Terminate into FPDUs
//! (headers, pad and CRC emitted by lwio-iwarp), and writing them with
//! gathered `writev`s straight from registered memory.

use super::*;

/// The header of a tagged segment (RDMA Write, Read Response).
fn tagged(opcode: Opcode, last: bool, stag: u32, to: u64) -> SegmentHeader {
    SegmentHeader {
        opcode,
        last,
        ddp: DdpKind::Tagged { stag, to },
        read_request: None,
    }
}

/// The header of an untagged segment; `inv` is the STag a Send with
/// Invalidate names (0 otherwise).
fn untagged(opcode: Opcode, last: bool, inv: u32, qn: u32, msn: u32, mo: u32) -> SegmentHeader {
    SegmentHeader {
        opcode,
        last,
        ddp: DdpKind::Untagged {
            rsvd_ulp: inv,
            qn,
            msn,
            mo,
        },
        read_request: None,
    }
}

impl TxFrame {
    /// The payload's length (the sum of its pieces).
    fn payload_len(&self) -> usize {
        self.pieces[..self.npieces]
            .iter()
            .map(|p| p.len as usize)
            .sum()
    }

    /// A copy of the frame's payload, made under the read fences of the
    /// regions it lies in (no other thread writes those bytes meanwhile:
    /// `soft::mem`, "The region fence is the region's reader-writer
    /// lock"). The pieces lie in registrations kept alive by the WR or the
    /// frame (an SQ WR completes only once its last frame is written, or in
    /// `enter_error`, which calls this first), or in the frame's own
    /// inline/staged buffers. `None` when a region that does not own its
    /// memory (`register_raw`) was deregistered: that memory may be gone.
    fn payload_copy(&self) -> Option<Vec<u8>> {
        let _fences = read_fences(self.keep.iter());
        if self
            .keep
            .iter()
            .any(|m| !m.owns_memory() && !m.valid.load(std::sync::atomic::Ordering::Acquire))
        {
            return None;
        }
        let mut own: Vec<u8> = Vec::with_capacity(self.payload_len());
        for p in &self.pieces[..self.npieces] {
            let at = own.len();
            // SAFETY: the piece is readable memory that the frame may send
            // from (above), read-fenced, and `own` has capacity for it;
            // `set_len` follows the copy, and only initialised bytes are
            // then exposed. No Rust reference to the source is formed.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    p.addr as *const u8,
                    own.as_mut_ptr().add(at),
                    p.len as usize,
                );
                own.set_len(at + p.len as usize);
            }
        }
        Some(own)
    }

    /// [`TxFrame::payload_copy`], or zeros of its length when the source
    /// was deregistered under a work request that still sends from it (the
    /// caller broke `register_raw`'s contract; nothing is read from memory
    /// that may be gone).
    fn payload_copy_or_zeros(&self) -> Vec<u8> {
        self.payload_copy().unwrap_or_else(|| {
            tracing::debug!("send source deregistered before its work request completed");
            vec![0; self.payload_len()]
        })
    }

    /// Send the payload from `own` (a copy of it) instead of its pieces.
    fn send_from(&mut self, own: Vec<u8>) {
        if !own.is_empty() {
            self.pieces[0] = Piece {
                addr: own.as_ptr() as u64,
                len: own.len() as u64,
            };
            self.npieces = 1;
        }
        self._staged = Some(own);
    }

    /// Make the frame send from its own copy of the payload, unless it
    /// already does (CRC on: staged; inline data). `enter_error` calls
    /// this for the partly written frame it keeps: the WRs it sends from
    /// are about to complete (flushed), after which the owner of
    /// `register_raw` memory may free it, and the frame's `keep` keeps
    /// only the registration's bookkeeping alive, not that memory.
    pub(super) fn own_payload(&mut self) {
        if self._staged.is_none() && self._inline.is_none() {
            let own = self.payload_copy_or_zeros();
            self.send_from(own);
        }
    }
}

impl QpEngine {
    /// Emit the header area of `f` for `h` (+ a Terminate's `body`), the
    /// payload being `f`'s pieces, and add the trailer (pad, CRC).
    fn seal_frame(&self, f: &mut TxFrame, h: &SegmentHeader, body: Option<&TerminateRepr>) {
        let payload = f.payload_len();
        f.hdr_len = emit_fpdu_header(h, body, payload, &mut f.hdr)
            .expect("TX_HDR holds every header and max_payload bounds the ULPDU");
        let ulpdu = f.hdr_len - MPA_HDR_LEN + payload;
        f.trailer = if self.p.crc {
            // Copy the payload into the frame once and checksum (and send)
            // that copy: no Rust reference to registered memory is formed,
            // and the bytes checksummed are exactly the bytes sent even if
            // the consumer (or another QP placing into the same region)
            // writes the source meanwhile.
            if f._staged.is_none() {
                let own = f.payload_copy_or_zeros();
                f.send_from(own);
            }
            let own = f._staged.as_deref().unwrap_or_default();
            Trailer::with_crc(ulpdu, &[&f.hdr[..f.hdr_len], own])
        } else {
            Trailer::without_crc(ulpdu)
        };
        f.total = f.hdr_len + payload + f.trailer.as_ref().len();
    }

    fn new_frame(owner: FrameOwner) -> TxFrame {
        TxFrame {
            hdr: [0; TX_HDR],
            hdr_len: 0,
            pieces: [Piece { addr: 0, len: 0 }; 8],
            npieces: 0,
            trailer: Trailer::without_crc(0),
            total: 0,
            written: 0,
            owner,
            keep: Regions::default(),
            _inline: None,
            _staged: None,
        }
    }

    /// Build the next frame to send, if any.
    fn next_frame(&mut self) -> Option<TxFrame> {
        if let Some(t) = self.term_out.take() {
            let mut f = Self::new_frame(FrameOwner::Term);
            let msn = self.msns.start_message(QN_TERMINATE).unwrap_or_default();
            let h = untagged(Opcode::Terminate, true, 0, QN_TERMINATE, msn, 0);
            self.seal_frame(&mut f, &h, Some(&t));
            return Some(f);
        }
        if self.state == QpState::Error {
            return None;
        }
        let irq_ready = self.irq.len() > self.irq_built;
        let use_irq = self.tx_cur_irq
            || (irq_ready
                && !self
                    .sq
                    .get(self.tx_idx)
                    .is_some_and(|w| w.started && !w.built));
        if use_irq && irq_ready {
            return match self.irq_frame() {
                Some(f) => Some(f),
                None => {
                    // The region was deregistered while the peer's Read was
                    // queued: answer as for a Read of an invalid STag.
                    self.fatal(TermKind::RdmapProtInvalidStag, false);
                    self.next_frame()
                }
            };
        }
        // Skip WRs already framed (local WRs are framed at post time).
        while self.sq.get(self.tx_idx).is_some_and(|w| w.built) {
            self.tx_idx += 1;
        }
        let w = self.sq.get(self.tx_idx)?;
        if !w.started {
            if w.fence && !self.orq.is_empty() {
                return None;
            }
            if matches!(w.kind, Kind::Read { .. }) && self.orq.len() >= self.p.ord.max(1) as usize {
                return None;
            }
        }
        Some(self.sq_frame())
    }

    /// The next Read Response frame; `None` if its source is caller-owned
    /// memory (`register_raw`) whose `Mr` was dropped since the request.
    fn irq_frame(&mut self) -> Option<TxFrame> {
        let maxp = self.p.max_payload as u64;
        let e = &mut self.irq[self.irq_built];
        let n = (e.len - e.sent).min(maxp);
        let last = e.sent + n == e.len;
        let mut f = Self::new_frame(FrameOwner::Irq { last });
        let h = tagged(
            Opcode::ReadResponse,
            last,
            e.sink_stag,
            e.sink_to.wrapping_add(e.sent),
        );
        if n > 0 {
            f.pieces[0] = Piece {
                addr: e.src + e.sent,
                len: n,
            };
            f.npieces = 1;
        }
        f.keep = Regions::one(e.mr.clone());
        if e.mr.as_ref().is_some_and(|m| n > 0 && !m.owns_memory()) {
            // Caller-owned memory stays allocated only while its `Mr` lives
            // (`Pd::register_raw`), and the frame may wait in the send queue
            // longer than that: copy the payload now, under the region's
            // fence, which deregistration takes (after clearing `valid`)
            // before the `Mr`'s drop returns.
            let own = f.payload_copy()?;
            f.send_from(own);
        }
        e.sent += n;
        e.started = true;
        self.tx_cur_irq = !last;
        if last {
            self.irq_built += 1;
        }
        self.seal_frame(&mut f, &h, None);
        Some(f)
    }

    fn sq_frame(&mut self) -> TxFrame {
        let maxp = self.p.max_payload as u64;
        let idx = self.tx_idx;
        let pd_msn;
        {
            let w = &mut self.sq[idx];
            if !w.started {
                w.started = true;
                let q = match w.kind {
                    Kind::Send { .. } => Some(QN_SEND),
                    Kind::Read { .. } => Some(QN_READ_REQUEST),
                    _ => None,
                };
                if let Some(q) = q {
                    w.msn = self.msns.start_message(q).unwrap_or_default();
                }
            }
            pd_msn = w.msn;
        }
        let w = &mut self.sq[idx];
        let mut f;
        match w.kind {
            Kind::Read { stag, to } => {
                f = Self::new_frame(FrameOwner::Sq {
                    seq: w.seq,
                    last: true,
                });
                let (sink_stag, sink_to) = match (w.pieces.first(), w.keep.first()) {
                    (Some(p), Some(k)) => (k.stag, p.addr),
                    _ => (0, 0),
                };
                let mut h = untagged(Opcode::ReadRequest, true, 0, QN_READ_REQUEST, pd_msn, 0);
                h.read_request = Some(ReadRequest {
                    sink_stag,
                    sink_to,
                    size: w.len as u32,
                    src_stag: stag,
                    src_to: to,
                });
                w.sent = w.len;
                w.built = true;
                self.orq.push_back(OrqEntry {
                    seq: w.seq,
                    sink_stag,
                    sink_to,
                    len: w.len,
                    got: 0,
                });
                self.seal_frame(&mut f, &h, None);
            }
            Kind::Write {
                imm: Some((imm, se)),
                ..
            } if w.sent == w.len => {
                // RDMA Write with Immediate: after the Write's last segment
                // (none for an empty Write), the RFC 7306 Immediate Data
                // message, which consumes a receive at the peer (with a
                // solicited event if the WR asked). 8 bytes: the value
                // big-endian, then zeros.
                f = Self::new_frame(FrameOwner::Sq {
                    seq: w.seq,
                    last: true,
                });
                let msn = self.msns.start_message(QN_SEND).unwrap_or_default();
                let opc = match se {
                    false => Opcode::ImmediateData,
                    true => Opcode::ImmediateDataSe,
                };
                let h = untagged(opc, true, 0, QN_SEND, msn, 0);
                let mut payload = vec![0u8; IMMEDIATE_DATA_LEN as usize];
                payload[..4].copy_from_slice(&imm.to_be_bytes());
                f.send_from(payload);
                w.built = true;
                self.seal_frame(&mut f, &h, None);
            }
            Kind::Send { .. } | Kind::Write { .. } => {
                let n = (w.len - w.sent).min(maxp);
                let last = w.sent + n == w.len;
                // A Write with Immediate ends with its Immediate Data frame.
                let imm_follows = matches!(w.kind, Kind::Write { imm: Some(_), .. });
                f = Self::new_frame(FrameOwner::Sq {
                    seq: w.seq,
                    last: last && !imm_follows,
                });
                let h = match w.kind {
                    Kind::Write { stag, to, .. } => {
                        tagged(Opcode::Write, last, stag, to.wrapping_add(w.sent))
                    }
                    Kind::Send { inv, se } => {
                        let opc = match (inv.is_some(), se) {
                            (false, false) => Opcode::Send,
                            (true, false) => Opcode::SendInvalidate,
                            (false, true) => Opcode::SendSe,
                            (true, true) => Opcode::SendSeInvalidate,
                        };
                        untagged(opc, last, inv.unwrap_or(0), QN_SEND, pd_msn, w.sent as u32)
                    }
                    _ => unreachable!(),
                };
                let mut v = Vec::with_capacity(4);
                map_pieces(&w.pieces, w.sent, n, &mut v);
                for (i, p) in v.into_iter().enumerate().take(8) {
                    f.pieces[i] = p;
                    f.npieces = i + 1;
                }
                // The frame keeps the WR's registrations alive, and names the
                // regions whose fences its transmission holds.
                f.keep = Regions::of(&w.keep);
                f._inline = w.inline.clone();
                w.sent += n;
                w.built = last && !imm_follows;
                self.seal_frame(&mut f, &h, None);
            }
            Kind::Local => unreachable!("local WRs are skipped"),
        }
        f
    }

    fn frame_done(&mut self, owner: FrameOwner) {
        match owner {
            FrameOwner::Term => {}
            FrameOwner::Irq { last } => {
                if last {
                    self.irq.pop_front();
                    self.irq_built = self.irq_built.saturating_sub(1);
                }
            }
            FrameOwner::Sq { seq, last } => {
                if !last {
                    return;
                }
                if let Some(i) = self.sq_index(seq) {
                    let w = &mut self.sq[i];
                    w.transmitted = true;
                    if !matches!(w.kind, Kind::Read { .. }) {
                        w.done = true;
                        w.byte_len = w.len as u32;
                    }
                }
                self.complete_sq();
            }
        }
    }

    /// Transmit until the socket is full or nothing is left. Up to
    /// `TX_BATCH` frames (`TX_BATCH_BYTES`) go out in one `sendmsg`.
    pub fn tx_process(&mut self, io: &mut dyn Io) -> io::Result<usize> {
        let mut frames = 0;
        let mut iov: Vec<libc::iovec> = Vec::new();
        loop {
            while self.txq.len() < TX_BATCH && self.txq_bytes < TX_BATCH_BYTES {
                match self.next_frame() {
                    Some(f) => {
                        self.txq_bytes += f.total - f.written;
                        self.txq.push_back(f);
                    }
                    None => break,
                }
            }
            if self.txq.is_empty() {
                break;
            }
            // The iovec list of everything unwritten.
            iov.clear();
            for f in &self.txq {
                let mut skip = f.written;
                let mut push = |base: *const u8, len: usize| {
                    if skip >= len {
                        skip -= len;
                        return;
                    }
                    iov.push(libc::iovec {
                        // SAFETY (pointer arithmetic): skip < len, inside the part.
                        iov_base: unsafe { base.add(skip) } as *mut libc::c_void,
                        iov_len: len - skip,
                    });
                    skip = 0;
                };
                push(f.hdr.as_ptr(), f.hdr_len);
                for p in &f.pieces[..f.npieces] {
                    push(p.addr as *const u8, p.len as usize);
                }
                push(f.trailer.as_ref().as_ptr(), f.trailer.as_ref().len());
            }
            // Held for the call: every region a frame sends from (frames
            // with a copy of their own read none).
            let fences = read_fences(
                self.txq
                    .iter()
                    .filter(|f| f._staged.is_none())
                    .flat_map(|f| f.keep.iter()),
            );
            // SAFETY: the iovecs cover the frames' own arrays, inline/staged
            // buffers owned by the frames, and payload pieces in registered
            // memory:
            // - an SQ WR's memory: the WR completes only after its last
            //   frame is written (`frame_done`), so owned memory (`RegBuf`,
            //   kept by the registration) and `register_raw` memory (the
            //   caller keeps it until the WR completes) are valid; after a
            //   flush the one frame left partly written sends from its own
            //   copy (`enter_error` → `own_payload`), not from memory whose
            //   WRs completed.
            // - an inbound Read's source: validated against a live
            //   registration when the request came; the frame's `keep`
            //   keeps a `RegBuf` mapped. A frame from `register_raw` memory
            //   sends from its own copy, taken when the frame was built
            //   under the region's fence while it was still registered
            //   (`irq_frame`), so it does not depend on the caller keeping
            //   that memory after dropping the `Mr`.
            // The kernel only reads them, on this thread's behalf, under the
            // read fences of every region a frame sends from (`fences`: no
            // other thread writes those bytes during the call).
            let r = unsafe { io.writev(&iov) };
            drop(fences);
            match r {
                Ok(mut w) => {
                    self.txq_bytes -= w;
                    while w > 0 {
                        let f = self
                            .txq
                            .front_mut()
                            .expect("written bytes belong to a frame");
                        let rem = f.total - f.written;
                        if w < rem {
                            f.written += w;
                            break;
                        }
                        w -= rem;
                        let owner = f.owner;
                        self.txq.pop_front();
                        frames += 1;
                        self.frame_done(owner);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if self.txq.is_empty() {
            self.graveyard.clear();
            if self.term_out.is_none() && self.shut == Shut::AfterTx {
                self.shut = Shut::Now;
            }
        }
        self.check_closing();
        Ok(frames)
    }
}
