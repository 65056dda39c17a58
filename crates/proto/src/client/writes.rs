//! The client's writes: WRITE and VEC_WRITE inline, and writes larger than
//! one message as fragments (seed 004, operations of any size;
//! docs/protocol.md §5.12).

use super::*;

impl<U: Default> ClientConn<U> {
    /// WRITE `data` at `offset` (inline; ≤ server MaxRecvBufferSize). The
    /// message is encoded now and queued for `poll_transmit`; a caller with
    /// its send buffer at hand uses [`ClientConn::write_into`] instead.
    pub fn write(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        data: &[u8],
        mode: Mode,
    ) -> Result<Issued, ClientError> {
        self.write_to(now, fid, offset, data, mode, None)
            .map(|(i, _)| i)
    }

    /// WRITE encoded straight into `out` (e.g. a registered send buffer):
    /// no intermediate copy of `data`. Returns the request and the message
    /// length; the caller sends `out[..len]`. Every message queued before
    /// must have left through `poll_transmit` (else `TransmitPending`).
    /// `out` shorter than the message: `InvalidArgument`, nothing recorded.
    pub fn write_into(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        data: &[u8],
        mode: Mode,
        out: &mut [u8],
    ) -> Result<(Issued, usize), ClientError> {
        self.write_to(now, fid, offset, data, mode, Some(out))
    }

    fn write_to(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        data: &[u8],
        mode: Mode,
        out: Option<&mut [u8]>,
    ) -> Result<(Issued, usize), ClientError> {
        self.check_payload(data.len())?;
        self.check_issue()?;
        if out
            .as_ref()
            .is_some_and(|o| o.len() < COMMON_HEADER_LEN + data.len())
        {
            return Err(ClientError::InvalidArgument);
        }
        let make = |cm| RequestOp::Write {
            fid,
            offset,
            data,
            mode: cm,
        };
        self.io_borrowed(now, mode, Opcode::Write, make, out)
    }

    /// The most data bytes one fragment carries: what the server's receive
    /// buffer holds (its MaxRecvBufferSize after a common header) less the
    /// fragment header. 0 when fragments are not in use on this connection.
    pub fn fragment_data_max(&self) -> u32 {
        match &self.server {
            Some(s) if self.cfg.fragments && s.max_message > 0 => {
                (s.max_recv_buffer_size as usize + COMMON_HEADER_LEN - FRAGMENT_HEADER_LEN)
                    .min(u32::MAX as usize) as u32
            }
            _ => 0,
        }
    }

    /// Fragments a write of `len` data bytes takes as one message with at
    /// most `cap` data bytes per fragment (0: it cannot be one: fragments
    /// not in use, or over MAX_MESSAGE).
    pub fn fragments_for(&self, len: u32, cap: u32) -> u32 {
        let per = self.fragment_data_max().min(cap);
        let max = self.server.as_ref().map_or(0, |s| s.max_message);
        match (COMMON_HEADER_LEN as u32).checked_add(len) {
            Some(total) if per > 0 && total <= max => total.div_ceil(per),
            _ => 0,
        }
    }

    /// The largest write (data bytes) one fragmented message can carry on
    /// this connection: within MAX_MESSAGE, and within `fragments` (at most
    /// the connection's credits: every fragment holds one until the
    /// message's status). 0 when fragments are not in use.
    /// `cap`: the most data bytes per fragment the caller sends.
    pub fn max_fragmented_write(&self, fragments: u32, cap: u32) -> u32 {
        let per = u64::from(self.fragment_data_max().min(cap));
        let max = u64::from(self.server.as_ref().map_or(0, |s| s.max_message));
        let n = u64::from(fragments.min(u32::from(self.credits)));
        (per * n).min(max).saturating_sub(COMMON_HEADER_LEN as u64) as u32
    }

    /// WRITE (`vec_page_size` None) or VEC_WRITE without COLLAPSE of `len`
    /// data bytes at `offset` as one fragmented message: one request, one
    /// status, holding one credit per fragment until then. The caller
    /// sends the returned fragments back to back, before any other message
    /// (every message queued before must have left: `TransmitPending`).
    /// `NoCredits` when that many credits are not free now;
    /// `TooManyFragments` when the connection has fewer credits than the
    /// message has fragments; `InvalidArgument` when fragments are not in
    /// use or the message is over MAX_MESSAGE. `cap`: the most data bytes
    /// per fragment the caller sends (its send buffer, when it copies).
    #[allow(clippy::too_many_arguments)]
    pub fn write_fragmented(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        len: u32,
        vec_page_size: Option<u16>,
        mode: Mode,
        cap: u32,
    ) -> Result<FragmentedWrite, ClientError> {
        let n = self.fragments_for(len, cap);
        if n == 0 {
            return Err(ClientError::InvalidArgument);
        }
        if n > u32::from(self.credits) {
            return Err(ClientError::TooManyFragments {
                fragments: n,
                credits: self.credits,
            });
        }
        self.check_issue()?;
        if self.credits_held() + n as usize > usize::from(self.credits) {
            return Err(ClientError::NoCredits);
        }
        if !self.transmit.is_empty() {
            return Err(ClientError::TransmitPending);
        }
        let (opcode, num_pages, page_size) = match vec_page_size {
            None => (Opcode::Write, 0, 0),
            Some(0) => return Err(ClientError::InvalidArgument),
            Some(ps) => {
                let pages = len.div_ceil(u32::from(ps));
                let np = u16::try_from(pages).map_err(|_| ClientError::InvalidArgument)?;
                (Opcode::VecWrite, np, ps)
            }
        };
        let (cookie, cm, slot, imm) = self.io_mode(mode)?;
        let op = match opcode {
            Opcode::Write => RequestOp::Write {
                fid,
                offset,
                data: &[],
                mode: cm,
            },
            _ => RequestOp::VecWrite {
                fid,
                offset,
                length: len,
                num_pages,
                page_size,
                collapse: false,
                data: &[],
                mode: cm,
            },
        };
        let r = self.repr(op);
        let mut head = [0u8; COMMON_HEADER_LEN];
        let header = r.header().map(|mut h| {
            h.length = len;
            h.emit(&mut HeaderPacket::new_unchecked(&mut head[..]));
        });
        if header.is_err() {
            if let Some(s) = slot {
                self.slot_unused(s);
            }
            return Err(ClientError::InvalidArgument);
        }
        self.record(now, &r, cookie, opcode, slot, imm);
        if let Some(o) = self.reqs.get_mut(&cookie) {
            o.extra_credits = n - 1;
        }
        self.extra_held += n as usize - 1;
        let per = self.fragment_data_max().min(cap);
        let fragments = crate::fragment::plan(COMMON_HEADER_LEN as u32 + len, per).collect();
        Ok(FragmentedWrite {
            issued: Issued { req: cookie, slot },
            head,
            fragments,
        })
    }

    /// VEC_WRITE. Without `collapse`, `data` holds all `length` bytes; with
    /// `collapse`, `data` is the single page repeated over
    /// ceil(length / page_size) pages.
    #[allow(clippy::too_many_arguments)]
    pub fn vec_write(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        page_size: u16,
        length: u32,
        data: &[u8],
        collapse: bool,
        mode: Mode,
    ) -> Result<Issued, ClientError> {
        let v = VecWrite {
            fid,
            offset,
            page_size,
            length,
            data,
            collapse,
        };
        self.vec_write_to(now, v, mode, None).map(|(i, _)| i)
    }

    /// VEC_WRITE encoded straight into `out`, as [`ClientConn::write_into`].
    pub fn vec_write_into(
        &mut self,
        now: Instant,
        v: VecWrite<'_>,
        mode: Mode,
        out: &mut [u8],
    ) -> Result<(Issued, usize), ClientError> {
        self.vec_write_to(now, v, mode, Some(out))
    }

    fn vec_write_to(
        &mut self,
        now: Instant,
        v: VecWrite<'_>,
        mode: Mode,
        out: Option<&mut [u8]>,
    ) -> Result<(Issued, usize), ClientError> {
        self.check_payload(v.data.len())?;
        if v.page_size == 0 {
            return Err(ClientError::InvalidArgument);
        }
        let pages = v.length.div_ceil(u32::from(v.page_size));
        let num_pages = u16::try_from(pages).map_err(|_| ClientError::InvalidArgument)?;
        let want = if v.collapse {
            (v.length as usize).min(usize::from(v.page_size))
        } else {
            v.length as usize
        };
        if v.data.len() != want {
            return Err(ClientError::InvalidArgument);
        }
        self.check_issue()?;
        let make = |cm| RequestOp::VecWrite {
            fid: v.fid,
            offset: v.offset,
            length: v.length,
            num_pages,
            page_size: v.page_size,
            collapse: v.collapse,
            data: v.data,
            mode: cm,
        };
        self.io_borrowed(now, mode, Opcode::VecWrite, make, out)
    }
}
