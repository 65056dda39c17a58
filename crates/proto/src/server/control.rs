//! The control requests: FLUSH, CANCEL, AUTH, REGISTER, CLOSE, CREDIT.

use super::*;

impl<U: OpData> ServerConn<U> {
    /// FLUSH (§5.13): the Fid's file synced on the server, answered when
    /// storage is done (`FileSync`). It is in flight like an I/O: a CLOSE
    /// waits for it, a CANCEL may withdraw it before it starts.
    pub(super) fn handle_flush(&mut self, fid: u16, data_only: bool, mode: CompletionMode) {
        if !self.cfg.flush {
            // Not offered: refused as an unknown request would be.
            return self.complete(mode, 0, STATUS_INVALID_DEVICE_REQUEST, false);
        }
        let file = match self.fids.get(&fid) {
            Some(f) if !f.closing => f.file,
            _ => return self.complete(mode, 0, STATUS_INVALID_HANDLE, false),
        };
        let (opcode, started) = self.cur.unwrap_or((Opcode::Flush, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind: IoKind::Sync,
            mode,
            requested: 0,
        });
        let action = ServerAction::FileSync {
            op,
            fid,
            file,
            data_only,
        };
        // Ordered after every write this connection received before it
        // (any Fid: two opens of one file are two Fids), so a client may
        // send its FLUSH without waiting for its writes' answers.
        let after: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(o, (p, _))| {
                **o != op && matches!(p.kind, IoKind::Write | IoKind::WriteParts { .. })
            })
            .map(|(o, _)| *o)
            .collect();
        if after.is_empty() {
            self.actions.push_back(action);
        } else {
            self.held_syncs.push(HeldSync { op, after, action });
        }
    }

    /// `op` has left storage (or was withdrawn): the FLUSHes held for it
    /// that wait for nothing else go to storage now.
    pub(super) fn release_held_syncs(&mut self, op: OpId) {
        if self.held_syncs.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.held_syncs.len() {
            let h = &mut self.held_syncs[i];
            h.after.retain(|o| *o != op);
            if h.after.is_empty() {
                let h = self.held_syncs.remove(i);
                self.actions.push_back(h.action);
            } else {
                i += 1;
            }
        }
    }

    /// CANCEL (§5.9): ask for the cancellation of every outstanding I/O of
    /// `fid` (`target` None), or of the one sent with `target`'s completion
    /// fields (none if it has completed already). Answered at once.
    ///
    /// An I/O whose FileRead/FileWrite the embedder has not taken yet (the
    /// request and its CANCEL came in one batch) is withdrawn and completed
    /// with STATUS_CANCELLED here: neither the embedder's inline path nor
    /// its storage ever starts it. The others get a `CancelIo`.
    pub(super) fn handle_cancel(
        &mut self,
        now: Instant,
        fid: u16,
        cookie: u64,
        target: Option<CancelTarget>,
        mode: CompletionMode,
    ) {
        if !self.fid_valid(fid) {
            return self.complete(mode, 0, STATUS_INVALID_HANDLE, false);
        }
        let mut ops: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, (p, _))| p.fid == fid && target.is_none_or(|t| t.matches(&p.mode)))
            .map(|(o, _)| *o)
            .collect();
        ops.sort_unstable();
        for op in ops {
            if let Some(i) = self.held_syncs.iter().position(|h| h.op == op) {
                // A FLUSH still waiting for earlier writes: it never starts.
                self.held_syncs.remove(i);
                self.handle_storage_complete(now, op, Err(STATUS_CANCELLED));
                continue;
            }
            let queued = self.actions.iter().position(|a| match a {
                ServerAction::FileRead { op: o, .. }
                | ServerAction::FileWrite { op: o, .. }
                | ServerAction::FileSync { op: o, .. }
                | ServerAction::FileWriteParts { op: o, .. } => *o == op,
                _ => false,
            });
            match queued {
                Some(i) => {
                    if let Some(ServerAction::FileWriteParts { parts, .. }) = self.actions.remove(i)
                    {
                        self.actions.push_back(ServerAction::RepostRecvs(
                            parts.into_iter().map(|(b, _)| b).collect(),
                        ));
                    }
                    self.handle_storage_complete(now, op, Err(STATUS_CANCELLED));
                }
                None => self.actions.push_back(ServerAction::CancelIo { op }),
            }
        }
        self.send_status(cookie, 0, STATUS_SUCCESS);
        self.outstanding = self.outstanding.saturating_sub(1);
    }

    pub(super) fn payload_ok(&self, len: usize) -> bool {
        u32::try_from(len).is_ok_and(|l| l <= self.cfg.max_recv_buffer_size)
    }

    pub(super) fn fid_valid(&self, fid: u16) -> bool {
        self.fids.get(&fid).is_some_and(|f| !f.closing)
    }

    pub(super) fn handle_auth(
        &mut self,
        cookie: u64,
        data_va: u64,
        data_mh: u32,
        params: &[u8],
        hooks: &mut dyn ServerHooks,
    ) {
        match self.verify_auth(params, hooks) {
            Ok((client, alg, secret)) => {
                let granted = client.credits.clamp(1, self.cfg.max_credits.clamp(1, 255));
                let mine = AuthParamsRepr {
                    rev_id: LWIO_REV_ID,
                    endian: ENDIAN_64,
                    page_size: self.cfg.page_size,
                    base_sequence: client.base_sequence.wrapping_add(1),
                    max_rdma_window_size: self.cfg.max_rdma_window_size,
                    max_send_buffer_size: self.cfg.max_send_buffer_size,
                    max_recv_buffer_size: self.cfg.max_recv_buffer_size,
                    header_size: COMMON_HEADER_LEN as u16,
                    credits: granted,
                    // Seed 000: 1 if the server supports RDMA Read. It
                    // issues RDMA Reads to publishers of memory objects
                    // (a WRITE's data still comes in its request message,
                    // so a client that does not support them is served).
                    rdma_read_supported: 1,
                    // lwio extensions it serves (§5.13).
                    features: if self.cfg.flush { FEATURE_FLUSH } else { 0 },
                    key: client.key,
                    session_id: Some(self.cfg.session_id),
                    signature: None,
                    max_message: self.cfg.max_message,
                };
                let bytes = match mine.to_signed_bytes(alg, &secret) {
                    Ok(b) => b,
                    Err(_) => return self.close(CloseReason::AuthFailed),
                };
                let info = (bytes.len() + 8) as u32;
                self.actions.push_back(ServerAction::RdmaWrite {
                    remote_addr: data_va,
                    rkey: data_mh,
                    data: DataSource::Inline(bytes),
                    imm: None,
                });
                self.send_status(cookie, info, STATUS_SUCCESS);
                self.outstanding = 0;
                self.credits = granted;
                self.client = Some(client);
                self.state = State::Ready;
            }
            Err(()) => {
                self.send_status(cookie, 0, STATUS_ACCESS_DENIED);
                self.close(CloseReason::AuthFailed);
            }
        }
    }

    pub(super) fn verify_auth(
        &self,
        params: &[u8],
        hooks: &mut dyn ServerHooks,
    ) -> Result<(AuthParamsRepr, SignatureAlg, Vec<u8>), ()> {
        let p = AuthParamsPacket::new_checked(params).map_err(|_| ())?;
        if p.total_len() != Ok(params.len()) {
            return Err(());
        }
        let client = AuthParamsRepr::parse(&p).map_err(|_| ())?;
        if client.rev_id != LWIO_REV_ID
            || usize::from(client.header_size) != COMMON_HEADER_LEN
            || !client.page_size.is_power_of_two()
        {
            return Err(());
        }
        let key = client.key.ok_or(())?;
        let secret = hooks.session_secret(&key).ok_or(())?;
        let (_, alg) = AuthParamsRepr::verify(params, &secret).map_err(|_| ())?;
        if alg == SignatureAlg::Md5 && !self.cfg.allow_md5 {
            return Err(());
        }
        if !hooks.auth_verified(&key) {
            return Err(());
        }
        Ok((client, alg, secret))
    }

    pub(super) fn handle_register(
        &mut self,
        cookie: u64,
        p: FidParamsRepr,
        hooks: &mut dyn ServerHooks,
    ) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        if p.session_id != self.cfg.session_id {
            return self.complete(mode, 0, STATUS_ACCESS_DENIED, false);
        }
        if self.fids.len() >= self.cfg.max_fids || self.fids.len() >= usize::from(u16::MAX) {
            return self.complete(mode, 0, STATUS_INSUFFICIENT_RESOURCES, false);
        }
        match hooks.open_file(&p.resume_key, p.flags_and_attributes) {
            Ok(file) => {
                let mut fid = self.next_fid;
                while fid == 0 || self.fids.contains_key(&fid) {
                    fid = fid.wrapping_add(1);
                }
                self.next_fid = fid.wrapping_add(1);
                self.fids.insert(
                    fid,
                    FileEntry {
                        file,
                        flags: p.flags_and_attributes,
                        closing: false,
                        inflight: 0,
                    },
                );
                self.complete(mode, u32::from(fid), STATUS_SUCCESS, false);
            }
            Err(st) => {
                let st = if st == STATUS_SUCCESS {
                    STATUS_ACCESS_DENIED
                } else {
                    st
                };
                self.complete(mode, 0, st, false)
            }
        }
    }

    pub(super) fn handle_close(&mut self, fid: u16, cookie: u64) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        match self.fids.get_mut(&fid) {
            Some(f) if !f.closing => {
                f.closing = true;
                self.maybe_finish_close(fid);
                self.complete(mode, 0, STATUS_SUCCESS, false);
            }
            _ => self.complete(mode, 0, STATUS_INVALID_HANDLE, false),
        }
    }

    pub(super) fn maybe_finish_close(&mut self, fid: u16) {
        if let Some(f) = self.fids.get(&fid) {
            if f.closing && f.inflight == 0 {
                let file = f.file;
                self.fids.remove(&fid);
                self.actions
                    .push_back(ServerAction::CloseFile { fid, file });
            }
        }
    }

    pub(super) fn handle_credit(&mut self, cookie: u64, value: i32) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        match self.credit_tx {
            None => self.close(CloseReason::ProtocolViolation("CREDIT without transaction")),
            Some(CreditTx::Positive { n, .. }) => {
                if !(0..=n).contains(&value) {
                    return self.close(CloseReason::ProtocolViolation("bad CREDIT value"));
                }
                self.unused_credits_reported = value as u32;
                self.credit_tx = None;
                self.complete(mode, 0, STATUS_SUCCESS, false);
            }
            Some(CreditTx::Negative { expect, deadline }) => {
                if value != expect {
                    return self.close(CloseReason::ProtocolViolation("CREDIT out of order"));
                }
                self.credits = self.credits.saturating_sub(1).max(1);
                self.credit_tx = if expect == -1 {
                    None
                } else {
                    Some(CreditTx::Negative {
                        expect: expect + 1,
                        deadline,
                    })
                };
                self.complete(mode, 0, LWIO_NOTIFY_CREDIT, false);
            }
        }
    }
}
