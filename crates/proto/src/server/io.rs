//! The I/O requests: checks, READs (long ones in pieces), VEC_READ,
//! WRITEs (in place, collapsed, reassembled), and their storage completions.

use super::*;

impl<U: OpData> ServerConn<U> {
    /// Common I/O validation: Fid and offset overflow.
    pub(super) fn check_io(&self, fid: u16, offset: u64, length: u32) -> Result<u64, NtStatus> {
        let f = match self.fids.get(&fid) {
            Some(f) if !f.closing => f,
            _ => return Err(STATUS_INVALID_HANDLE),
        };
        if offset.checked_add(u64::from(length)).is_none() {
            return Err(STATUS_INVALID_PARAMETER);
        }
        Ok(f.file)
    }

    pub(super) fn new_op(&mut self, p: PendingIo) -> OpId {
        let op = self.next_op;
        self.next_op = self.next_op.wrapping_add(1).max(1);
        if let Some(f) = self.fids.get_mut(&p.fid) {
            f.inflight += 1;
        }
        self.ops.insert(op, (p, U::default()));
        op
    }

    pub(super) fn start_read(
        &mut self,
        fid: u16,
        offset: u64,
        length: u32,
        kind: IoKind,
        mode: CompletionMode,
    ) {
        let file = match self.check_io(fid, offset, length) {
            Ok(f) => f,
            Err(st) => return self.complete_io(mode, 0, st, false),
        };
        if length > self.cfg.max_rdma_window_size {
            // Longer than a read buffer: in pieces, when the client may
            // ask for it (the server announced MAX_MESSAGE).
            return match kind {
                IoKind::Read { data_va, data_mh } if length <= self.cfg.max_message => {
                    let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
                    self.start_big_read(BigRead {
                        fid,
                        file,
                        offset,
                        length,
                        data_va,
                        data_mh,
                        mode,
                        opcode,
                        started,
                        next: 0,
                        inflight: 0,
                        results: BTreeMap::new(),
                        stopped: false,
                    })
                }
                _ => self.complete_io(mode, 0, STATUS_INVALID_PARAMETER, false),
            };
        }
        if length == 0 {
            return self.complete_io(mode, 0, STATUS_SUCCESS, false);
        }
        let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind,
            mode,
            requested: length,
        });
        self.actions.push_back(ServerAction::FileRead {
            op,
            fid,
            file,
            offset,
            len: length,
        });
    }

    pub(super) fn start_big_read(&mut self, b: BigRead) {
        let id = self.next_big;
        self.next_big = self.next_big.wrapping_add(1).max(1);
        self.big_reads.insert(id, b);
        self.read_pieces(id);
    }

    /// Start pieces of big read `id` while fewer than
    /// [`READ_PIECES_IN_FLIGHT`] are at storage.
    pub(super) fn read_pieces(&mut self, id: u64) {
        let window = self.cfg.max_rdma_window_size.max(1);
        loop {
            let Some(b) = self.big_reads.get_mut(&id) else {
                return;
            };
            if b.stopped || b.inflight >= READ_PIECES_IN_FLIGHT || b.next >= b.length {
                return;
            }
            let at = b.next;
            let len = window.min(b.length - at);
            b.next += len;
            b.inflight += 1;
            let (fid, file, offset, mode) = (b.fid, b.file, b.offset + u64::from(at), b.mode);
            let (opcode, started) = (b.opcode, b.started);
            let op = self.new_op(PendingIo {
                opcode,
                started,
                fid,
                kind: IoKind::ReadPiece { parent: id, at },
                mode,
                requested: len,
            });
            self.actions.push_back(ServerAction::FileRead {
                op,
                fid,
                file,
                offset,
                len,
            });
        }
    }

    /// A piece of big read `id` came back: its bytes go to the client's
    /// window now; the status goes when the last piece is back (the bytes
    /// read from the start up to the first short or failed piece).
    pub(super) fn read_piece_done(
        &mut self,
        op: OpId,
        id: u64,
        at: u32,
        asked: u32,
        r: Result<u32, NtStatus>,
    ) {
        let Some(b) = self.big_reads.get_mut(&id) else {
            return;
        };
        b.inflight = b.inflight.saturating_sub(1);
        let r = read_result(r, asked);
        if let Ok(n) = r {
            self.actions.push_back(ServerAction::RdmaWrite {
                remote_addr: b.data_va.wrapping_add(u64::from(at)),
                rkey: b.data_mh,
                data: DataSource::ReadBuffer {
                    op,
                    offset: 0,
                    len: n,
                },
                imm: None,
            });
        }
        if r != Ok(asked) {
            b.stopped = true;
        }
        b.results.insert(at, (asked, r));
        if b.inflight > 0 || (!b.stopped && b.next < b.length) {
            return self.read_pieces(id);
        }
        let Some(b) = self.big_reads.remove(&id) else {
            return;
        };
        let (mut total, mut status) = (0u32, STATUS_SUCCESS);
        for (at, (asked, r)) in &b.results {
            if *at != total {
                break;
            }
            match r {
                Ok(n) => {
                    total += n;
                    if n < asked {
                        break;
                    }
                }
                Err(st) => {
                    if total == 0 {
                        status = *st;
                    }
                    break;
                }
            }
        }
        self.complete_io(b.mode, total, status, false);
    }

    pub(super) fn handle_vec_read(
        &mut self,
        fid: u16,
        offset: u64,
        length: u32,
        page_size: u16,
        regions: Vec<RdmaRegion>,
        mode: CompletionMode,
    ) {
        let max_regions = (self.cfg.max_recv_buffer_size / 16) as usize;
        if regions.len() > max_regions {
            return self.close(CloseReason::PayloadTooLarge);
        }
        if let Err(st) = self.check_vec_read(length, page_size, &regions) {
            return self.complete_io(mode, 0, st, false);
        }
        self.start_read(fid, offset, length, IoKind::VecRead { regions }, mode)
    }

    pub(super) fn check_vec_read(
        &self,
        length: u32,
        page_size: u16,
        regions: &[RdmaRegion],
    ) -> Result<(), NtStatus> {
        let ps = u32::from(page_size);
        if ps == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let want_pages = length.div_ceil(ps) as usize;
        if regions.len() != want_pages || regions.is_empty() {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let (last, mids) = regions.split_last().ok_or(STATUS_INVALID_PARAMETER)?;
        if mids.iter().any(|r| r.length != ps) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let sector = self.cfg.sector_size.max(1);
        if last.length == 0 || last.length > ps || last.length % sector != 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let total = u64::from(ps) * mids.len() as u64 + u64::from(last.length);
        if total != u64::from(length) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        Ok(())
    }

    pub(super) fn expand_collapsed(
        &self,
        fid: u16,
        length: u32,
        num_pages: u16,
        page_size: u16,
        page: &[u8],
    ) -> Result<Vec<u8>, NtStatus> {
        let f = match self.fids.get(&fid) {
            Some(f) if !f.closing => f,
            _ => return Err(STATUS_INVALID_HANDLE),
        };
        if f.flags & FILE_NO_INTERMEDIATE_BUFFERING == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let client_ps = self.client.as_ref().map_or(0, |c| c.page_size);
        let (a, b) = (u32::from(client_ps), u32::from(self.cfg.page_size));
        if a == 0 || b == 0 || (a.max(b) % a.min(b)) != 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let ps = u32::from(page_size);
        if ps == 0 || u32::from(num_pages) != length.div_ceil(ps) || length == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        // A window's worth, or (an lwio extension negotiated with
        // MAX_MESSAGE, docs/protocol.md §5.12) up to MAX_MESSAGE.
        if length > self.cfg.max_rdma_window_size.max(self.cfg.max_message) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let mut out = Vec::with_capacity(length as usize);
        while out.len() < length as usize {
            let take = page.len().min(length as usize - out.len());
            if take == 0 {
                return Err(STATUS_INVALID_PARAMETER);
            }
            out.extend_from_slice(&page[..take]);
        }
        Ok(out)
    }

    /// A write whose data is the request's own bytes, `data`, the tail of
    /// `msg` (a WRITE's payload, or a VEC_WRITE's without COLLAPSE): lent
    /// from receive buffer `buf` to a one-part `FileWriteParts` (`Kept`),
    /// or — without a buffer (`RecvId::MAX`, [`ServerConn::handle_recv`])
    /// — copied into a `FileWrite`. A write answered at once (refused, or
    /// empty) keeps nothing.
    pub(super) fn write_in_place(
        &mut self,
        fid: u16,
        offset: u64,
        buf: RecvId,
        msg: &[u8],
        data: &[u8],
        mode: CompletionMode,
    ) -> RecvBuffer {
        if buf == RecvId::MAX {
            self.start_write(fid, offset, data.to_vec(), mode);
            return RecvBuffer::Repost;
        }
        let range = msg.len().saturating_sub(data.len())..msg.len();
        debug_assert!(std::ptr::eq(&msg[range.clone()], data));
        let Some((op, file)) = self.new_write(fid, offset, data.len(), mode) else {
            return RecvBuffer::Repost;
        };
        self.actions.push_back(ServerAction::FileWriteParts {
            op,
            fid,
            file,
            offset,
            parts: vec![(buf, range)],
        });
        RecvBuffer::Kept
    }

    /// A FileWrite of `data`; its op, unless it was answered at once.
    pub(super) fn start_write(
        &mut self,
        fid: u16,
        offset: u64,
        data: Vec<u8>,
        mode: CompletionMode,
    ) -> Option<OpId> {
        let (op, file) = self.new_write(fid, offset, data.len(), mode)?;
        self.actions.push_back(ServerAction::FileWrite {
            op,
            fid,
            file,
            offset,
            data,
        });
        Some(op)
    }

    /// The op of a write of `len` bytes and its file, unless it was
    /// answered at once: refused (`check_io`), or empty.
    pub(super) fn new_write(
        &mut self,
        fid: u16,
        offset: u64,
        len: usize,
        mode: CompletionMode,
    ) -> Option<(OpId, u64)> {
        // (At most a message's size, or MAX_MESSAGE for a COLLAPSE
        // expansion: within u32.)
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        let file = match self.check_io(fid, offset, len) {
            Ok(f) => f,
            Err(st) => {
                self.complete_io(mode, 0, st, false);
                return None;
            }
        };
        if len == 0 {
            self.complete_io(mode, 0, STATUS_SUCCESS, false);
            return None;
        }
        let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind: IoKind::Write,
            mode,
            requested: len,
        });
        Some((op, file))
    }

    /// A storage operation finished: `Ok(bytes transferred)` or the failure
    /// status (STATUS_CANCELLED for a cancelled operation). Unknown ops are
    /// ignored. The op's data is dropped, or kept for
    /// [`ServerConn::take_done_data`] when [`OpData::outlives_op`] says so.
    pub fn handle_storage_complete(
        &mut self,
        now: Instant,
        op: OpId,
        result: Result<u32, NtStatus>,
    ) {
        let Some((p, data)) = self.ops.remove(&op) else {
            return;
        };
        if data.outlives_op() {
            self.done.insert(op, data);
        }
        self.reservations.remove(&op);
        if self.state == State::Closed {
            // After CloseConnection nothing is produced; the embedder
            // releases every buffer and file of the connection itself.
            return;
        }
        self.release_held_syncs(op);
        // (Also called while a CANCEL is handled: its request comes back.)
        let outer = (self.cur.replace((p.opcode, p.started)), self.now);
        self.now = self.now.max(now);
        self.storage_complete(op, p, result);
        (self.cur, self.now) = outer;
    }

    pub(super) fn storage_complete(
        &mut self,
        op: OpId,
        p: PendingIo,
        result: Result<u32, NtStatus>,
    ) {
        if let Some(f) = self.fids.get_mut(&p.fid) {
            f.inflight = f.inflight.saturating_sub(1);
        }
        let is_read = matches!(
            p.kind,
            IoKind::Read { .. } | IoKind::VecRead { .. } | IoKind::ReadPiece { .. }
        );
        {
            match p.kind {
                IoKind::ReadPiece { parent, at } => {
                    self.read_piece_done(op, parent, at, p.requested, result)
                }
                IoKind::WriteParts { extra } => {
                    match result {
                        Ok(n) => {
                            self.complete_io(p.mode, n.min(p.requested), STATUS_SUCCESS, false)
                        }
                        Err(st) => self.complete_io(p.mode, 0, normalize(st), false),
                    }
                    self.outstanding = self.outstanding.saturating_sub(extra);
                }
                IoKind::Sync => match result {
                    Ok(_) => self.complete(p.mode, 0, STATUS_SUCCESS, false),
                    Err(st) => self.complete(p.mode, 0, normalize(st), false),
                },
                IoKind::Write => match result {
                    Ok(n) => self.complete_io(p.mode, n.min(p.requested), STATUS_SUCCESS, false),
                    Err(st) => self.complete_io(p.mode, 0, normalize(st), false),
                },
                IoKind::Read { data_va, data_mh } => match read_result(result, p.requested) {
                    Ok(n) => {
                        let imm = self.imm_for(&p.mode, n, p.requested);
                        self.actions.push_back(ServerAction::RdmaWrite {
                            remote_addr: data_va,
                            rkey: data_mh,
                            data: DataSource::ReadBuffer {
                                op,
                                offset: 0,
                                len: n,
                            },
                            imm,
                        });
                        self.complete_io(p.mode, n, STATUS_SUCCESS, imm.is_some());
                    }
                    Err(st) => self.complete_io(p.mode, 0, st, false),
                },
                IoKind::VecRead { ref regions } => match read_result(result, p.requested) {
                    Ok(n) => {
                        let imm = self.imm_for(&p.mode, n, p.requested);
                        let mut off = 0u32;
                        let mut writes = Vec::new();
                        for r in regions {
                            if off >= n {
                                break;
                            }
                            let len = r.length.min(n - off);
                            writes.push((r.data_va, r.data_mh, off, len));
                            off += len;
                        }
                        let last = writes.len().saturating_sub(1);
                        for (i, (va, mh, o, len)) in writes.into_iter().enumerate() {
                            self.actions.push_back(ServerAction::RdmaWrite {
                                remote_addr: va,
                                rkey: mh,
                                data: DataSource::ReadBuffer { op, offset: o, len },
                                imm: if i == last { imm } else { None },
                            });
                        }
                        self.complete_io(p.mode, n, STATUS_SUCCESS, imm.is_some());
                    }
                    Err(st) => self.complete_io(p.mode, 0, st, false),
                },
            }
        }
        if is_read {
            self.actions
                .push_back(ServerAction::ReleaseReadBuffer { op });
        }
        self.maybe_finish_close(p.fid);
    }

    /// The client said in AUTH that its device receives RDMA Writes with
    /// Immediate (FEATURES bit 1): a seed-only client, or one on a device
    /// without them (Linux siw), is completed by status messages.
    fn peer_accepts_immediate(&self) -> bool {
        self.client
            .as_ref()
            .is_some_and(|c| c.features & FEATURE_IMMEDIATE != 0)
    }

    pub(super) fn imm_for(&self, mode: &CompletionMode, n: u32, requested: u32) -> Option<u32> {
        match *mode {
            CompletionMode::Interrupt {
                immediate_cookie, ..
            } if self.cfg.use_write_with_imm
                && self.peer_accepts_immediate()
                && n == requested
                && n > 0 =>
            {
                Some(immediate_cookie)
            }
            _ => None,
        }
    }
}
