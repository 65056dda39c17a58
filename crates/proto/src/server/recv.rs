//! Receiving: a message or a fragment of one, its credit, reassembly, and
//! the dispatch of each request to its handler.

use super::*;

impl<U: OpData> ServerConn<U> {
    /// A fragment: opcode 10 where a request's opcode is, on a connection
    /// whose server takes fragments (elsewhere opcode 10 is unknown, and the
    /// message malformed).
    pub(super) fn is_fragment(&self, msg: &[u8]) -> bool {
        self.cfg.max_message > 0 && msg.get(4) == Some(&OPCODE_FRAGMENT)
    }

    /// Take one credit for an arriving message (a request or a fragment);
    /// false (and the connection closed) when the client had none left.
    pub(super) fn take_credit(&mut self) -> bool {
        if u32::from(self.credits) <= self.outstanding {
            self.close(CloseReason::CreditOverflow);
            return false;
        }
        self.outstanding += 1;
        true
    }

    pub(super) fn recv_fragment(
        &mut self,
        now: Instant,
        buf: RecvId,
        msg: &[u8],
        hooks: &mut dyn ServerHooks,
    ) -> RecvBuffer {
        if self.state == State::Closed {
            return RecvBuffer::Repost;
        }
        if self.state == State::AwaitAuth {
            self.close(CloseReason::ProtocolViolation("fragment before AUTH"));
            return RecvBuffer::Repost;
        }
        self.stats.fragments += 1;
        let parsed = FragmentPacket::new_checked(msg)
            .ok()
            .filter(|p| p.data_length() as usize + FRAGMENT_HEADER_LEN == msg.len())
            .and_then(|p| FragmentRepr::parse(&p).ok());
        let Some(f) = parsed else {
            return self.fragment_violation(FragmentError::Malformed);
        };
        if !self.take_credit() {
            self.reasm.abort();
            self.frag = None;
            return RecvBuffer::Repost;
        }
        let data = FRAGMENT_HEADER_LEN..msg.len();
        if f.first {
            match self.fragment_head(now, &msg[data.clone()], &f) {
                Ok(h) => self.frag = Some(h),
                Err(e) => return self.fragment_violation(e),
            }
        }
        match self.reasm.push(&f, buf, data) {
            Err(rej) => {
                self.frag = None;
                self.close(CloseReason::Fragment(rej.error));
                RecvBuffer::Repost
            }
            Ok(None) => {
                if let Some(h) = self.frag.as_mut() {
                    h.frags += 1;
                }
                RecvBuffer::Kept
            }
            Ok(Some(msg)) => {
                let Some(mut h) = self.frag.take() else {
                    self.close(CloseReason::Fragment(FragmentError::NotStarted));
                    return RecvBuffer::Repost;
                };
                h.frags += 1;
                self.largest_message = self.largest_message.max(h.frags);
                self.stats.messages_reassembled += 1;
                self.write_assembled(h, msg, hooks);
                RecvBuffer::Kept
            }
        }
    }

    pub(super) fn fragment_violation(&mut self, e: FragmentError) -> RecvBuffer {
        self.reasm.abort();
        self.frag = None;
        self.close(CloseReason::Fragment(e));
        RecvBuffer::Repost
    }

    /// The request in a FIRST fragment's data: a WRITE or a VEC_WRITE
    /// (without COLLAPSE) whose common header lies wholly in this fragment
    /// and whose Length is the rest of the message.
    pub(super) fn fragment_head(
        &self,
        now: Instant,
        data: &[u8],
        f: &FragmentRepr,
    ) -> Result<FragHead, FragmentError> {
        let hp = HeaderPacket::new_checked(data).map_err(|_| FragmentError::Malformed)?;
        let h = HeaderRepr::parse(&hp).map_err(|_| FragmentError::Malformed)?;
        let opcode = match Opcode::from_u8(h.opcode) {
            Some(o @ (Opcode::Write | Opcode::VecWrite)) => o,
            _ => return Err(FragmentError::Malformed),
        };
        let fl = h.flags;
        if fl.0 & !Flags::ALL != 0 || fl.control() || fl.collapse() {
            return Err(FragmentError::Malformed);
        }
        let total = f.message_length().ok_or(FragmentError::Malformed)?;
        if u64::from(h.length) + COMMON_HEADER_LEN as u64 != u64::from(total) {
            return Err(FragmentError::Malformed);
        }
        let mode = CompletionMode::from_header(&h);
        if let CompletionMode::Interrupt { cookie: 0, .. } = mode {
            return Err(FragmentError::Malformed);
        }
        Ok(FragHead {
            opcode,
            fid: h.fid,
            offset: h.offset,
            mode,
            started: now,
            frags: 0,
        })
    }

    /// A whole fragmented message: one write over the buffers it landed
    /// in, answered by one status that gives back all its credits.
    pub(super) fn write_assembled(
        &mut self,
        h: FragHead,
        m: crate::fragment::Assembled<RecvId>,
        hooks: &mut dyn ServerHooks,
    ) {
        let _ = hooks;
        self.stats.received(h.opcode);
        self.cur = Some((h.opcode, h.started));
        let extra = h.frags.saturating_sub(1);
        let mut parts = m.parts;
        if let Some((_, r)) = parts.first_mut() {
            r.start = (r.start + COMMON_HEADER_LEN).min(r.end);
        }
        let len = m.len.saturating_sub(COMMON_HEADER_LEN as u32);
        let refuse = |s: &mut Self, st: NtStatus, parts: Vec<(RecvId, Range<usize>)>| {
            s.actions.push_back(ServerAction::RepostRecvs(
                parts.into_iter().map(|(b, _)| b).collect(),
            ));
            s.complete_io(h.mode, 0, st, false);
            s.outstanding = s.outstanding.saturating_sub(extra);
        };
        let file = match self.check_io(h.fid, h.offset, len) {
            Ok(f) => f,
            Err(st) => return refuse(self, st, parts),
        };
        if len == 0 {
            return refuse(self, STATUS_SUCCESS, parts);
        }
        let op = self.new_op(PendingIo {
            opcode: h.opcode,
            started: h.started,
            fid: h.fid,
            kind: IoKind::WriteParts { extra },
            mode: h.mode,
            requested: len,
        });
        self.reservations.insert(op, m.reservation);
        self.actions.push_back(ServerAction::FileWriteParts {
            op,
            fid: h.fid,
            file,
            offset: h.offset,
            parts,
        });
    }

    /// A whole message in buffer `buf`; `kept` becomes `Kept` when a
    /// write's data is lent from it.
    pub(super) fn recv(
        &mut self,
        now: Instant,
        buf: RecvId,
        kept: &mut RecvBuffer,
        msg: &[u8],
        hooks: &mut dyn ServerHooks,
    ) {
        if self.state == State::Closed {
            return;
        }
        let req = match RequestRepr::parse(msg) {
            Ok(r) => r,
            Err(_) => return self.close(CloseReason::ProtocolViolation("malformed message")),
        };
        let opcode = req.opcode();
        self.stats.received(opcode);
        if matches!(
            opcode,
            Opcode::Read | Opcode::Write | Opcode::VecRead | Opcode::VecWrite
        ) {
            self.data_requests += 1;
        }
        self.cur = Some((opcode, now));
        let mode = req.mode();
        if let CompletionMode::Interrupt { cookie: 0, .. } = mode {
            return self.close(CloseReason::ProtocolViolation("cookie 0"));
        }
        if !self.take_credit() {
            return;
        }
        self.credit_hint = req.credits;
        self.peak_hint = self.peak_hint.max(req.credits);
        if self.state == State::AwaitAuth {
            return match req.op {
                RequestOp::Auth {
                    cookie,
                    data_va,
                    data_mh,
                    params,
                } => self.handle_auth(cookie, data_va, data_mh, params, hooks),
                _ => {
                    if let CompletionMode::Interrupt { cookie, .. } = mode {
                        self.send_status(cookie, 0, STATUS_ACCESS_DENIED);
                    }
                    self.close(CloseReason::ProtocolViolation("request before AUTH"))
                }
            };
        }
        match req.op {
            RequestOp::Auth { .. } => self.close(CloseReason::ProtocolViolation("second AUTH")),
            RequestOp::Register { cookie, params } => self.handle_register(cookie, params, hooks),
            RequestOp::Read {
                fid,
                offset,
                length,
                data_va,
                data_mh,
                mode,
            } => self.start_read(fid, offset, length, IoKind::Read { data_va, data_mh }, mode),
            RequestOp::VecRead {
                fid,
                offset,
                length,
                page_size,
                regions,
                mode,
            } => self.handle_vec_read(fid, offset, length, page_size, regions, mode),
            RequestOp::Write {
                fid,
                offset,
                data,
                mode,
            } => {
                if !self.payload_ok(data.len()) {
                    return self.close(CloseReason::PayloadTooLarge);
                }
                *kept = self.write_in_place(fid, offset, buf, msg, data, mode)
            }
            RequestOp::VecWrite {
                fid,
                offset,
                length,
                num_pages,
                page_size,
                collapse,
                data,
                mode,
            } => {
                if !self.payload_ok(data.len()) {
                    return self.close(CloseReason::PayloadTooLarge);
                }
                if !collapse {
                    // Its data is the rest of the message, as a WRITE's.
                    *kept = self.write_in_place(fid, offset, buf, msg, data, mode);
                    return;
                }
                // Longer than a window (up to MAX_MESSAGE): the expansion
                // is server memory, reserved from the fragment budget.
                let reserved = if length > self.cfg.max_rdma_window_size {
                    match self.budget.reserve(length as usize) {
                        Some(r) => Some(r),
                        None => {
                            return self.complete_io(mode, 0, STATUS_INSUFFICIENT_RESOURCES, false)
                        }
                    }
                } else {
                    None
                };
                match self.expand_collapsed(fid, length, num_pages, page_size, data) {
                    Ok(buf) => {
                        if let Some(op) = self.start_write(fid, offset, buf, mode) {
                            if let Some(r) = reserved {
                                self.reservations.insert(op, r);
                            }
                        }
                    }
                    Err(st) => self.complete_io(mode, 0, st, false),
                }
            }
            RequestOp::Close { fid, cookie } => self.handle_close(fid, cookie),
            RequestOp::Cancel { fid, cookie } => self.handle_cancel(now, fid, cookie, None, mode),
            RequestOp::CancelIo {
                fid,
                cookie,
                target,
            } => self.handle_cancel(now, fid, cookie, Some(target), mode),
            RequestOp::Credit { cookie, value } => self.handle_credit(cookie, value),
            RequestOp::Interrupt { cookie } => {
                if self.interrupt.is_some() {
                    self.complete(mode, 0, STATUS_INVALID_DEVICE_REQUEST, false);
                } else {
                    // Answered (and its credit released) by the next I/O completion.
                    self.interrupt = Some((cookie, now));
                }
            }
            RequestOp::Flush { fid, data_only, .. } => self.handle_flush(fid, data_only, mode),
        }
    }
}
