//! Operations of any size (seed 004, after SMB Direct): a message larger than
//! the peer's receive buffer travels as a run of LWIO_FRAGMENT sends
//! (`wire::fragment`, docs/protocol.md §5.12), and the receiver puts it back
//! together. Sans-IO: the sender's [`plan`] says which bytes go in which
//! fragment (the data can stay where it is: a send's second SGE), and the
//! receiver's [`Reassembler`] keeps the receive buffers the fragments landed
//! in, without copying, until the message is whole.
//!
//! Rules (each violation is a [`FragmentError`] with its NTSTATUS; the
//! connection is then terminated and the buffers given back):
//! * fragments of one message are sent back to back: a FIRST fragment while
//!   a message is being assembled is an error, so is a fragment that does
//!   not start where the previous one ended, or one whose
//!   MessageOffset + DataLength + RemainingDataLength differs from the
//!   message length the FIRST fragment announced;
//! * a message longer than the negotiated maximum is refused at its FIRST
//!   fragment, before anything is kept;
//! * receive memory held by partial messages is bounded per connection (one
//!   message at a time, at most the maximum) and per server (a shared
//!   [`Budget`], reserved for the whole message at its FIRST fragment).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::status::{
    NtStatus, STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_BUFFER_SIZE, STATUS_INVALID_PARAMETER,
};
use crate::wire::fragment::FragmentRepr;

/// The fragments of a `message_len`-byte message with at most `max_data`
/// data bytes each (the peer's receive size less the 16-byte header).
/// Empty for an empty message or a zero `max_data`.
pub fn plan(message_len: u32, max_data: u32) -> impl Iterator<Item = FragmentRepr> {
    let mut off = 0u32;
    std::iter::from_fn(move || {
        if max_data == 0 || off >= message_len {
            return None;
        }
        let n = max_data.min(message_len - off);
        let f = FragmentRepr {
            data_length: n,
            first: off == 0,
            last: off + n == message_len,
            message_offset: off,
            remaining: message_len - off - n,
        };
        off += n;
        Some(f)
    })
}

/// Receive memory that partial messages may hold across a server.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Reserve `n` bytes until the [`Reservation`] is dropped; `None` when
    /// that would pass the limit.
    pub fn reserve(self: &Arc<Self>, n: usize) -> Option<Reservation> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.limit)
            })
            .ok()?;
        Some(Reservation {
            budget: self.clone(),
            bytes: n,
        })
    }
}

/// Bytes of a [`Budget`] held until dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Why a fragment was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentError {
    /// A header the wire parser refused, or data that does not match it.
    Malformed,
    /// The message is longer than the negotiated maximum.
    TooLarge { len: u32, max: u32 },
    /// Receive memory across the server is exhausted.
    NoMemory,
    /// A FIRST fragment while another message is being assembled.
    Interleaved,
    /// A later fragment with no message being assembled.
    NotStarted,
    /// The fragment does not start where the previous one ended.
    OutOfOrder { expected: u32, got: u32 },
    /// Offset + DataLength + RemainingDataLength differs from the length
    /// the FIRST fragment announced.
    LengthMismatch { announced: u32, now: u32 },
    /// Another message (not a fragment) arrived before the LAST fragment.
    Missing,
}

impl FragmentError {
    /// The NTSTATUS a server terminates the connection with.
    pub fn status(&self) -> NtStatus {
        match self {
            FragmentError::TooLarge { .. } => STATUS_INVALID_BUFFER_SIZE,
            FragmentError::NoMemory => STATUS_INSUFFICIENT_RESOURCES,
            _ => STATUS_INVALID_PARAMETER,
        }
    }
}

impl std::fmt::Display for FragmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FragmentError::Malformed => f.write_str("malformed fragment"),
            FragmentError::TooLarge { len, max } => {
                write!(f, "message of {len} bytes is over the negotiated {max}")
            }
            FragmentError::NoMemory => f.write_str("out of receive memory for fragments"),
            FragmentError::Interleaved => {
                f.write_str("a new message began before the last one was complete")
            }
            FragmentError::NotStarted => f.write_str("a fragment of no message"),
            FragmentError::OutOfOrder { expected, got } => {
                write!(f, "fragment at offset {got}, expected {expected}")
            }
            FragmentError::LengthMismatch { announced, now } => write!(
                f,
                "fragment says the message is {now} bytes, its first said {announced}"
            ),
            FragmentError::Missing => f.write_str("a message arrived before the last fragment"),
        }
    }
}

/// A refused fragment: the error, and every buffer the reassembler held
/// (the partial message's and the refused fragment's), to give back.
#[derive(Debug)]
pub struct Rejected<B> {
    pub error: FragmentError,
    pub buffers: Vec<B>,
}

/// A whole message: its length and where its bytes are, in order.
#[derive(Debug)]
pub struct Assembled<B> {
    pub len: u32,
    /// The receive buffers and the byte range of each that holds message
    /// data, in message order.
    pub parts: Vec<(B, Range<usize>)>,
    /// Server receive memory held until the message is done with.
    pub reservation: Reservation,
}

#[derive(Debug)]
struct Partial<B> {
    len: u32,
    got: u32,
    parts: Vec<(B, Range<usize>)>,
    reservation: Reservation,
}

/// Puts one connection's fragmented messages back together (one message at
/// a time). `B` is the receiver's handle of a receive buffer.
#[derive(Debug)]
pub struct Reassembler<B> {
    max_message: u32,
    budget: Arc<Budget>,
    cur: Option<Partial<B>>,
}

impl<B> Reassembler<B> {
    /// `max_message`: the negotiated largest message; `budget`: the
    /// server-wide bound on receive memory held by partial messages.
    pub fn new(max_message: u32, budget: Arc<Budget>) -> Reassembler<B> {
        Reassembler {
            max_message,
            budget,
            cur: None,
        }
    }

    /// A message is being assembled.
    pub fn in_progress(&self) -> bool {
        self.cur.is_some()
    }

    /// Bytes of the message being assembled so far.
    pub fn pending_bytes(&self) -> u32 {
        self.cur.as_ref().map_or(0, |p| p.got)
    }

    /// Take a fragment whose data is `range` of `buf`. Returns the message
    /// when this was its LAST fragment. On a violation the partial message
    /// is dropped and every buffer comes back in [`Rejected`].
    pub fn push(
        &mut self,
        frag: &FragmentRepr,
        buf: B,
        range: Range<usize>,
    ) -> Result<Option<Assembled<B>>, Rejected<B>> {
        match self.check(frag, &range) {
            Ok(()) => {}
            Err(error) => {
                let mut buffers = self.abort();
                buffers.push(buf);
                return Err(Rejected { error, buffers });
            }
        }
        let p = match self.cur.as_mut() {
            Some(p) => p,
            None => {
                // check() guarantees FIRST here and reserves nothing yet.
                let len = frag.message_length().unwrap_or(0);
                let Some(reservation) = self.budget.reserve(len as usize) else {
                    return Err(Rejected {
                        error: FragmentError::NoMemory,
                        buffers: vec![buf],
                    });
                };
                self.cur.insert(Partial {
                    len,
                    got: 0,
                    parts: Vec::new(),
                    reservation,
                })
            }
        };
        p.got += frag.data_length;
        p.parts.push((buf, range));
        if !frag.last {
            return Ok(None);
        }
        let p = self.cur.take().expect("a message in progress");
        Ok(Some(Assembled {
            len: p.len,
            parts: p.parts,
            reservation: p.reservation,
        }))
    }

    fn check(&self, frag: &FragmentRepr, range: &Range<usize>) -> Result<(), FragmentError> {
        let len = frag.message_length().ok_or(FragmentError::Malformed)?;
        if range.end < range.start
            || range.len() != frag.data_length as usize
            || frag.data_length == 0
            || frag.first != (frag.message_offset == 0)
            || frag.last != (frag.remaining == 0)
        {
            return Err(FragmentError::Malformed);
        }
        match &self.cur {
            None if !frag.first => Err(FragmentError::NotStarted),
            None if len > self.max_message => Err(FragmentError::TooLarge {
                len,
                max: self.max_message,
            }),
            None => Ok(()),
            Some(_) if frag.first => Err(FragmentError::Interleaved),
            Some(p) if frag.message_offset != p.got => Err(FragmentError::OutOfOrder {
                expected: p.got,
                got: frag.message_offset,
            }),
            Some(p) if len != p.len => Err(FragmentError::LengthMismatch {
                announced: p.len,
                now: len,
            }),
            Some(_) => Ok(()),
        }
    }

    /// Drop the message being assembled (another message arrived before
    /// its LAST fragment — [`FragmentError::Missing`] — or the connection
    /// ends) and give its buffers back.
    pub fn abort(&mut self) -> Vec<B> {
        self.cur
            .take()
            .map(|p| p.parts.into_iter().map(|(b, _)| b).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::fragment::{FragmentPacket, FRAGMENT_HEADER_LEN};
    use proptest::prelude::*;

    /// Send `msg` as fragments of at most `max` bytes, each in its own
    /// "receive buffer" (header + data), through a reassembler.
    fn send(r: &mut Reassembler<Vec<u8>>, msg: &[u8], max: u32) -> Vec<u8> {
        let mut out = None;
        for f in plan(msg.len() as u32, max) {
            let mut b = vec![0u8; FRAGMENT_HEADER_LEN + f.data_length as usize];
            f.emit(&mut b);
            let o = f.message_offset as usize;
            b[FRAGMENT_HEADER_LEN..].copy_from_slice(&msg[o..o + f.data_length as usize]);
            let p = FragmentPacket::new_checked(&b[..]).unwrap();
            let f = FragmentRepr::parse(&p).unwrap();
            let range = FRAGMENT_HEADER_LEN..b.len();
            assert!(out.is_none());
            out = r.push(&f, b, range).unwrap();
        }
        let a = out.expect("message complete after its LAST fragment");
        assert_eq!(a.len as usize, msg.len());
        let mut v = Vec::new();
        for (b, range) in &a.parts {
            v.extend_from_slice(&b[range.clone()]);
        }
        v
    }

    #[test]
    fn plan_shapes() {
        let v: Vec<_> = plan(10, 4).collect();
        assert_eq!(v.len(), 3);
        assert!(v[0].first && !v[0].last && v[0].remaining == 6);
        assert_eq!(
            (v[1].message_offset, v[1].data_length, v[1].remaining),
            (4, 4, 2)
        );
        assert!(v[2].last && v[2].data_length == 2);
        assert_eq!(plan(0, 4).count(), 0);
        assert_eq!(plan(4, 0).count(), 0);
        let one: Vec<_> = plan(3, 4).collect();
        assert!(one[0].first && one[0].last);
    }

    #[test]
    fn sixteen_mib_plus_three_in_64k_fragments() {
        let budget = Budget::new(32 << 20);
        let mut r = Reassembler::new(16 << 20 | 3, budget.clone());
        let msg: Vec<u8> = (0..(16u32 << 20) + 3)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        assert_eq!(send(&mut r, &msg, 65536 - 16), msg);
        assert_eq!(budget.used(), 0, "the reservation went with the message");
    }

    fn frag(first: bool, off: u32, len: u32, remaining: u32) -> FragmentRepr {
        FragmentRepr {
            data_length: len,
            first,
            last: remaining == 0,
            message_offset: off,
            remaining,
        }
    }

    #[test]
    fn every_violation_gives_every_buffer_back() {
        let budget = Budget::new(1 << 20);
        let mut r: Reassembler<u32> = Reassembler::new(1000, budget.clone());
        // too large: refused at the first fragment, nothing reserved
        let e = r.push(&frag(true, 0, 10, 991), 1, 0..10).unwrap_err();
        assert_eq!(
            e.error,
            FragmentError::TooLarge {
                len: 1001,
                max: 1000
            }
        );
        assert_eq!(e.error.status(), STATUS_INVALID_BUFFER_SIZE);
        assert_eq!(e.buffers, vec![1]);
        assert_eq!(budget.used(), 0);
        // not started
        let e = r.push(&frag(false, 10, 10, 0), 2, 0..10).unwrap_err();
        assert_eq!(e.error, FragmentError::NotStarted);
        assert_eq!(e.buffers, vec![2]);
        // out of order (a missing fragment), after two good ones
        assert!(r.push(&frag(true, 0, 10, 90), 3, 0..10).unwrap().is_none());
        assert_eq!(budget.used(), 100);
        assert!(r
            .push(&frag(false, 10, 10, 80), 4, 0..10)
            .unwrap()
            .is_none());
        let e = r.push(&frag(false, 30, 10, 60), 5, 0..10).unwrap_err();
        assert_eq!(
            e.error,
            FragmentError::OutOfOrder {
                expected: 20,
                got: 30
            }
        );
        assert_eq!(e.error.status(), STATUS_INVALID_PARAMETER);
        assert_eq!(e.buffers, vec![3, 4, 5]);
        assert!(!r.in_progress());
        assert_eq!(budget.used(), 0);
        // RemainingDataLength that does not add up
        r.push(&frag(true, 0, 10, 90), 6, 0..10).unwrap();
        let e = r.push(&frag(false, 10, 10, 70), 7, 0..10).unwrap_err();
        assert_eq!(
            e.error,
            FragmentError::LengthMismatch {
                announced: 100,
                now: 90
            }
        );
        assert_eq!(e.buffers, vec![6, 7]);
        // a flood of first fragments: the second one is refused
        r.push(&frag(true, 0, 10, 90), 8, 0..10).unwrap();
        let e = r.push(&frag(true, 0, 10, 90), 9, 0..10).unwrap_err();
        assert_eq!(e.error, FragmentError::Interleaved);
        assert_eq!(e.buffers, vec![8, 9]);
        // data that does not match the header
        let e = r.push(&frag(true, 0, 10, 0), 10, 0..9).unwrap_err();
        assert_eq!(e.error, FragmentError::Malformed);
        // a truncated message: the connection ends before LAST
        r.push(&frag(true, 0, 10, 90), 11, 0..10).unwrap();
        assert_eq!(r.pending_bytes(), 10);
        assert_eq!(r.abort(), vec![11]);
        assert_eq!(budget.used(), 0, "nothing leaks");
    }

    #[test]
    fn the_server_budget_bounds_partial_messages() {
        let budget = Budget::new(150);
        let mut a: Reassembler<u8> = Reassembler::new(1000, budget.clone());
        let mut b: Reassembler<u8> = Reassembler::new(1000, budget.clone());
        a.push(&frag(true, 0, 10, 90), 1, 0..10).unwrap();
        let e = b.push(&frag(true, 0, 10, 90), 2, 0..10).unwrap_err();
        assert_eq!(e.error, FragmentError::NoMemory);
        assert_eq!(e.error.status(), STATUS_INSUFFICIENT_RESOURCES);
        assert_eq!(e.buffers, vec![2]);
        let done = a.push(&frag(false, 10, 90, 0), 3, 0..90).unwrap().unwrap();
        assert_eq!(done.parts.len(), 2);
        assert_eq!(budget.used(), 100, "held while the message is in use");
        drop(done);
        assert_eq!(budget.used(), 0);
        assert!(b.push(&frag(true, 0, 10, 90), 4, 0..10).unwrap().is_none());
    }

    proptest! {
        /// Random fragmentations of random messages reassemble exactly.
        #[test]
        fn random_fragmentations_reassemble(
            msg in proptest::collection::vec(any::<u8>(), 1..20_000),
            max in 1u32..5000,
        ) {
            let budget = Budget::new(1 << 20);
            let mut r = Reassembler::new(1 << 20, budget.clone());
            prop_assert_eq!(send(&mut r, &msg, max), msg);
            prop_assert_eq!(budget.used(), 0);
        }

        /// Arbitrary header sequences never panic, and whatever is refused
        /// or aborted gives every buffer back with nothing reserved.
        #[test]
        fn arbitrary_sequences_never_leak(
            frags in proptest::collection::vec(
                (any::<bool>(), 0u32..300, 0u32..120, 0u32..300, 0usize..130), 1..40),
        ) {
            let budget = Budget::new(400);
            let mut r: Reassembler<usize> = Reassembler::new(500, budget.clone());
            let mut given = 0usize;
            let mut back = 0usize;
            for (i, (first, off, len, rem, rlen)) in frags.into_iter().enumerate() {
                let f = FragmentRepr { data_length: len, first, last: rem == 0, message_offset: off, remaining: rem };
                given += 1;
                match r.push(&f, i, 0..rlen) {
                    Ok(Some(a)) => back += a.parts.len(),
                    Ok(None) => {}
                    Err(e) => back += e.buffers.len(),
                }
            }
            back += r.abort().len();
            prop_assert_eq!(given, back);
            prop_assert_eq!(budget.used(), 0);
        }
    }
}
