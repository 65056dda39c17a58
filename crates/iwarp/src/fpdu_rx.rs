//! Incremental FPDU deframer ([`FpduReceiver`]).
//!
//! Feeds on the TCP byte stream (split anywhere) and produces, per FPDU:
//! [`FpduEvent::Header`] once the DDP/RDMAP header is complete,
//! [`FpduEvent::Payload`] chunks (slices of *your* input, tagged with their
//! offset in the segment payload), and [`FpduEvent::End`] once pad and CRC
//! are received and verified. It never buffers payload: its memory is
//! the 48-byte header, the 8-byte trailer and a few counters.
//!
//! Zero-copy placement: after a `Header` event the caller may instead read
//! up to [`FpduReceiver::payload_remaining`] bytes from the socket straight
//! into target memory and report them with
//! [`FpduReceiver::advance_placed`], which keeps the CRC running.

use crate::wire::mpa::{self, CRC_LEN, MPA_HDR_LEN};
use crate::wire::rdmap::TerminateRepr;
use crate::wire::segment::{self, SegmentHeader, MAX_HDR_LEN};
use crate::wire::term::{TermError, TermKind};

/// Receive-side framing configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpduConfig {
    /// CRC negotiated: verify it. When off, the CRC field is ignored.
    pub crc: bool,
    /// Largest ULPDU_Length accepted (at most 65535).
    pub max_ulpdu: u16,
}

impl Default for FpduConfig {
    fn default() -> Self {
        FpduConfig {
            crc: false,
            max_ulpdu: u16::MAX,
        }
    }
}

/// Event produced by [`FpduReceiver::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FpduEvent<'a> {
    /// The DDP/RDMAP header of a new segment; `payload_len` bytes follow.
    Header {
        /// Parsed header.
        header: SegmentHeader,
        /// ULPDU_Length of the FPDU.
        ulpdu_len: u16,
        /// Payload length (ULPDU minus headers).
        payload_len: u32,
    },
    /// Payload bytes at `offset` in the segment payload.
    Payload {
        /// Offset from the start of this segment's payload.
        offset: u32,
        /// The bytes (a subslice of the input).
        data: &'a [u8],
    },
    /// Segment complete; CRC verified if enabled.
    End,
}

/// A framing or header error, with the Terminate to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("iWARP receive error: {error}")]
pub struct RxError {
    /// Classification.
    pub error: TermError,
    /// The Terminate message body to send to the peer (unless the error
    /// was caused by a received Terminate).
    pub terminate: TerminateRepr,
}

impl RxError {
    pub(crate) fn plain(error: TermError) -> RxError {
        RxError {
            error,
            terminate: TerminateRepr::new(error),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Len,
    Hdr,
    Payload,
    Trailer,
    Failed,
}

/// Incremental FPDU deframer. See the module docs.
#[derive(Debug, Clone)]
pub struct FpduReceiver {
    cfg: FpduConfig,
    state: State,
    /// ULPDU_Length (2 bytes) followed by the DDP/RDMAP header.
    hdr: [u8; MPA_HDR_LEN + MAX_HDR_LEN],
    have: usize,
    need: usize,
    ulpdu_len: u16,
    payload_len: u32,
    payload_done: u32,
    trailer: [u8; 3 + CRC_LEN],
    crc: u32,
    error: Option<RxError>,
}

impl FpduReceiver {
    /// New deframer at an FPDU boundary.
    pub fn new(cfg: FpduConfig) -> Self {
        FpduReceiver {
            cfg,
            state: State::Len,
            hdr: [0; MPA_HDR_LEN + MAX_HDR_LEN],
            have: 0,
            need: MPA_HDR_LEN,
            ulpdu_len: 0,
            payload_len: 0,
            payload_done: 0,
            trailer: [0; 3 + CRC_LEN],
            crc: 0,
            error: None,
        }
    }

    /// Configuration.
    pub fn config(&self) -> FpduConfig {
        self.cfg
    }

    /// True between FPDUs (nothing partially received).
    pub fn at_boundary(&self) -> bool {
        self.state == State::Len && self.have == 0
    }

    /// Raw DDP/RDMAP header bytes of the current segment (as much as has
    /// been received), for building a Terminate.
    pub fn header_bytes(&self) -> &[u8] {
        self.hdr
            .get(MPA_HDR_LEN..self.have.max(MPA_HDR_LEN))
            .unwrap_or(&[])
    }

    /// ULPDU_Length of the current FPDU (0 before it is known).
    pub fn ulpdu_len(&self) -> u16 {
        self.ulpdu_len
    }

    /// Payload bytes of the current segment not yet received.
    pub fn payload_remaining(&self) -> u32 {
        if self.state == State::Payload {
            self.payload_len - self.payload_done
        } else {
            0
        }
    }

    fn fail(&mut self, e: RxError) -> RxError {
        self.state = State::Failed;
        self.error = Some(e);
        e
    }

    fn fail_segment(&mut self, err: TermError) -> RxError {
        let t = TerminateRepr::for_segment(err, self.ulpdu_len, self.header_bytes());
        self.fail(RxError {
            error: err,
            terminate: t,
        })
    }

    /// Report `data.len()` payload bytes the caller placed itself (read
    /// from the socket directly into target memory). Must not exceed
    /// [`payload_remaining`](Self::payload_remaining).
    pub fn advance_placed(&mut self, data: &[u8]) -> Result<(), RxError> {
        if self.state != State::Payload || data.len() as u64 > self.payload_remaining() as u64 {
            return Err(self.fail(RxError::plain(TermKind::DdpLocalCatastrophic.into())));
        }
        if self.cfg.crc {
            self.crc = crc32c::crc32c_append(self.crc, data);
        }
        self.payload_done += data.len() as u32;
        if self.payload_done == self.payload_len {
            self.enter_trailer();
        }
        Ok(())
    }

    /// Report `n` payload bytes the caller placed itself without CRC
    /// (read from the socket straight into target memory, which must not
    /// be read back: a peer may write it). Only when CRC is off; must not
    /// exceed [`payload_remaining`](Self::payload_remaining).
    pub fn advance_len(&mut self, n: u32) -> Result<(), RxError> {
        if self.cfg.crc || self.state != State::Payload || n > self.payload_remaining() {
            return Err(self.fail(RxError::plain(TermKind::DdpLocalCatastrophic.into())));
        }
        self.payload_done += n;
        if self.payload_done == self.payload_len {
            self.enter_trailer();
        }
        Ok(())
    }

    fn enter_trailer(&mut self) {
        self.state = State::Trailer;
        self.have = 0;
        self.need = mpa::pad_len(self.ulpdu_len as usize) + CRC_LEN;
    }

    /// Consume bytes from `input`. Returns how many bytes were consumed and
    /// at most one event. `(n, None)` with `n == input.len()` means more
    /// input is needed. After an error every call returns the same error.
    pub fn poll<'a>(&mut self, input: &'a [u8]) -> Result<(usize, Option<FpduEvent<'a>>), RxError> {
        let mut used = 0;
        loop {
            let rest = &input[used..];
            match self.state {
                State::Failed => {
                    return Err(self
                        .error
                        .unwrap_or(RxError::plain(TermKind::DdpLocalCatastrophic.into())))
                }
                State::Len | State::Hdr => {
                    let n = (self.need - self.have).min(rest.len());
                    self.hdr[self.have..self.have + n].copy_from_slice(&rest[..n]);
                    self.have += n;
                    used += n;
                    if self.have < self.need {
                        return Ok((used, None));
                    }
                    if let Some(ev) = self.header_progress()? {
                        return Ok((used, Some(ev)));
                    }
                }
                State::Payload => {
                    if self.payload_done == self.payload_len {
                        self.enter_trailer();
                        continue;
                    }
                    let left = (self.payload_len - self.payload_done) as usize;
                    let n = left.min(rest.len());
                    if n == 0 {
                        return Ok((used, None));
                    }
                    let data = &rest[..n];
                    let offset = self.payload_done;
                    if self.cfg.crc {
                        self.crc = crc32c::crc32c_append(self.crc, data);
                    }
                    self.payload_done += n as u32;
                    used += n;
                    if self.payload_done == self.payload_len {
                        self.enter_trailer();
                    }
                    return Ok((used, Some(FpduEvent::Payload { offset, data })));
                }
                State::Trailer => {
                    let n = (self.need - self.have).min(rest.len());
                    self.trailer[self.have..self.have + n].copy_from_slice(&rest[..n]);
                    self.have += n;
                    used += n;
                    if self.have < self.need {
                        return Ok((used, None));
                    }
                    if self.cfg.crc {
                        let pad = self.need - CRC_LEN;
                        self.crc = crc32c::crc32c_append(self.crc, &self.trailer[..pad]);
                        let t = &self.trailer[pad..pad + CRC_LEN];
                        let got = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
                        if got != self.crc {
                            return Err(self.fail(RxError::plain(TermKind::MpaCrc.into())));
                        }
                    }
                    self.state = State::Len;
                    self.have = 0;
                    self.need = MPA_HDR_LEN;
                    return Ok((used, Some(FpduEvent::End)));
                }
            }
        }
    }

    /// Called when `have == need` in Len/Hdr state.
    fn header_progress(&mut self) -> Result<Option<FpduEvent<'static>>, RxError> {
        if self.state == State::Len {
            self.ulpdu_len = u16::from_be_bytes([self.hdr[0], self.hdr[1]]);
            if self.ulpdu_len > self.cfg.max_ulpdu || (self.ulpdu_len as usize) < 2 {
                return Err(self.fail(RxError::plain(TermKind::MpaMarkerLengthMismatch.into())));
            }
            self.state = State::Hdr;
            self.need = MPA_HDR_LEN + 2;
            return Ok(None);
        }
        if self.need == MPA_HDR_LEN + 2 {
            let hl = match segment::header_len([self.hdr[2], self.hdr[3]]) {
                Ok(hl) => hl,
                Err(e) => return Err(self.fail_segment(e)),
            };
            if hl > self.ulpdu_len as usize {
                return Err(self.fail(RxError::plain(TermKind::MpaMarkerLengthMismatch.into())));
            }
            self.need = MPA_HDR_LEN + hl;
            if self.need > self.have {
                return Ok(None);
            }
        }
        let (header, hl) = match SegmentHeader::parse(&self.hdr[MPA_HDR_LEN..self.need]) {
            Ok(x) => x,
            Err(e) => return Err(self.fail_segment(e)),
        };
        if self.cfg.crc {
            self.crc = crc32c::crc32c(&self.hdr[..self.need]);
        }
        self.payload_len = self.ulpdu_len as u32 - hl as u32;
        self.payload_done = 0;
        self.state = State::Payload;
        Ok(Some(FpduEvent::Header {
            header,
            ulpdu_len: self.ulpdu_len,
            payload_len: self.payload_len,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ddp::Kind;
    use crate::wire::rdmap::Opcode;

    fn write_fpdu(payload: &[u8], crc: bool) -> Vec<u8> {
        let h = SegmentHeader {
            opcode: Opcode::Write,
            last: true,
            ddp: Kind::Tagged { stag: 7, to: 100 },
            read_request: None,
        };
        let mut u = vec![0u8; 14];
        h.emit(&mut u).unwrap();
        u.extend_from_slice(payload);
        mpa::build_fpdu(&u, crc).unwrap()
    }

    #[test]
    fn one_fpdu_whole() {
        let f = write_fpdu(b"hello", true);
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: true,
            ..Default::default()
        });
        let (n, ev) = rx.poll(&f).unwrap();
        assert_eq!(n, 16);
        assert!(matches!(ev, Some(FpduEvent::Header { payload_len: 5, .. })));
        let (n2, ev) = rx.poll(&f[n..]).unwrap();
        assert_eq!(
            ev,
            Some(FpduEvent::Payload {
                offset: 0,
                data: b"hello"
            })
        );
        let (n3, ev) = rx.poll(&f[n + n2..]).unwrap();
        assert_eq!(ev, Some(FpduEvent::End));
        assert_eq!(n + n2 + n3, f.len());
        assert!(rx.at_boundary());
    }

    #[test]
    fn crc_error() {
        let mut f = write_fpdu(b"hello", true);
        let last = f.len() - 1;
        f[last] ^= 1;
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: true,
            ..Default::default()
        });
        let mut off = 0;
        let err = loop {
            match rx.poll(&f[off..]) {
                Ok((n, _)) => off += n,
                Err(e) => break e,
            }
        };
        assert_eq!(err.error.kind(), Some(TermKind::MpaCrc));
        assert_eq!(err.terminate.to_vec(), [0x20, 0x02, 0, 0]);
        assert_eq!(rx.poll(&[]).unwrap_err(), err);
        // Without CRC negotiated the field is ignored.
        let mut rx = FpduReceiver::new(FpduConfig::default());
        let mut off = 0;
        let mut ends = 0;
        while off < f.len() {
            let (n, ev) = rx.poll(&f[off..]).unwrap();
            off += n;
            ends += usize::from(ev == Some(FpduEvent::End));
        }
        assert_eq!(ends, 1);
    }

    #[test]
    fn length_errors() {
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: false,
            max_ulpdu: 100,
        });
        let e = rx.poll(&[0, 101]).unwrap_err();
        assert_eq!(e.error.kind(), Some(TermKind::MpaMarkerLengthMismatch));
        let mut rx = FpduReceiver::new(FpduConfig::default());
        // ULPDU of 10 cannot hold a tagged header.
        let e = rx.poll(&[0, 10, 0xc1, 0x40]).unwrap_err();
        assert_eq!(e.error.kind(), Some(TermKind::MpaMarkerLengthMismatch));
        let mut rx = FpduReceiver::new(FpduConfig::default());
        let e = rx.poll(&[0, 1]).unwrap_err();
        assert_eq!(e.error.kind(), Some(TermKind::MpaMarkerLengthMismatch));
        let mut rx = FpduReceiver::new(FpduConfig::default());
        let e = rx.poll(&[0, 20, 0xc2, 0x40]).unwrap_err();
        assert_eq!(e.error.kind(), Some(TermKind::DdpTaggedInvalidVersion));
        assert_eq!(e.terminate.buffer_len(), 4);
    }

    #[test]
    fn placed_payload() {
        let f = write_fpdu(&[9u8; 40], true);
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: true,
            ..Default::default()
        });
        let (n, _) = rx.poll(&f).unwrap();
        assert_eq!(rx.payload_remaining(), 40);
        rx.advance_placed(&f[n..n + 40]).unwrap();
        assert_eq!(rx.payload_remaining(), 0);
        let (_, ev) = rx.poll(&f[n + 40..]).unwrap();
        assert_eq!(ev, Some(FpduEvent::End));
        assert!(rx.advance_placed(&[1]).is_err());
    }

    #[test]
    fn length_only_advance_without_crc() {
        let payload: Vec<u8> = (0..100u8).collect();
        let f = write_fpdu(&payload, false);
        let mut rx = FpduReceiver::new(FpduConfig::default());
        let (n, ev) = rx.poll(&f).unwrap();
        assert!(matches!(
            ev,
            Some(FpduEvent::Header {
                payload_len: 100,
                ..
            })
        ));
        // 60 bytes placed by the caller, the rest through poll.
        rx.advance_len(60).unwrap();
        assert_eq!(rx.payload_remaining(), 40);
        let (m, ev) = rx.poll(&f[n + 60..]).unwrap();
        assert_eq!(
            ev,
            Some(FpduEvent::Payload {
                offset: 60,
                data: &payload[60..]
            })
        );
        let (_, ev) = rx.poll(&f[n + 60 + m..]).unwrap();
        assert_eq!(ev, Some(FpduEvent::End));
        assert!(rx.at_boundary());
        // Beyond the payload: refused, and the receiver stays failed.
        let mut rx = FpduReceiver::new(FpduConfig::default());
        rx.poll(&f).unwrap();
        assert!(rx.advance_len(101).is_err());
        assert!(rx.poll(&f[n..]).is_err());
        // With CRC the bytes must be seen: a length-only advance is refused.
        let f = write_fpdu(&payload, true);
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: true,
            ..Default::default()
        });
        rx.poll(&f).unwrap();
        assert!(rx.advance_len(10).is_err());
    }
}
