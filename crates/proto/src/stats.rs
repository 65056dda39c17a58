//! Request counters that a [`crate::server::ServerConn`] keeps as it serves:
//! requests and bytes by opcode, a latency histogram by opcode, and the
//! error statuses it answered with. Sans-IO like the state machine: time
//! comes from the `now` the embedder passes in, so the counts are exact in
//! the deterministic tests. The server adds each connection's counters into
//! its own totals ([`RequestStats::merge`]) and exposes them (Prometheus,
//! `lwio stats`).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::status::{NtStatus, STATUS_SUCCESS};
use crate::wire::common::Opcode;

/// Every opcode, in wire order (the index of each is [`op_index`]; 10 is
/// LWIO_FRAGMENT, which is not a request).
pub const OPCODES: [Opcode; 11] = [
    Opcode::Read,
    Opcode::Write,
    Opcode::VecRead,
    Opcode::VecWrite,
    Opcode::Close,
    Opcode::Cancel,
    Opcode::Auth,
    Opcode::Register,
    Opcode::Credit,
    Opcode::Interrupt,
    Opcode::Flush,
];

/// Where `op` is in [`OPCODES`] and [`RequestStats::ops`].
pub fn op_index(op: Opcode) -> usize {
    match op {
        Opcode::Flush => 10,
        o => o as usize,
    }
}

/// The name of an opcode as metrics label it.
pub fn opcode_name(op: Opcode) -> &'static str {
    match op {
        Opcode::Read => "read",
        Opcode::Write => "write",
        Opcode::VecRead => "vec_read",
        Opcode::VecWrite => "vec_write",
        Opcode::Close => "close",
        Opcode::Cancel => "cancel",
        Opcode::Auth => "auth",
        Opcode::Register => "register",
        Opcode::Credit => "credit",
        Opcode::Interrupt => "interrupt",
        Opcode::Flush => "flush",
    }
}

/// Upper bounds of the latency buckets, in microseconds (the last bucket,
/// +Inf, is implicit). From the page-cache fast path (a few µs) to a slow
/// disk or a stalled peer (a second).
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000,
];

/// Counters of one opcode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpStats {
    /// Requests received.
    pub requests: u64,
    /// Requests answered (a status sent or a status block written).
    pub completed: u64,
    /// Data bytes moved by the completed requests (READ: bytes returned,
    /// WRITE: bytes written).
    pub bytes: u64,
    /// Completions per latency bucket (not cumulative); index
    /// `LATENCY_BOUNDS_US.len()` is +Inf.
    pub latency_buckets: [u64; LATENCY_BOUNDS_US.len() + 1],
    /// Sum of the completions' latencies, in nanoseconds.
    pub latency_sum_ns: u64,
}

impl OpStats {
    fn observe(&mut self, latency: Duration, bytes: u32) {
        self.completed += 1;
        self.bytes += u64::from(bytes);
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.latency_buckets[i] += 1;
        self.latency_sum_ns = self
            .latency_sum_ns
            .saturating_add(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
    }

    fn merge(&mut self, o: &OpStats) {
        self.requests += o.requests;
        self.completed += o.completed;
        self.bytes += o.bytes;
        for (a, b) in self.latency_buckets.iter_mut().zip(o.latency_buckets) {
            *a += b;
        }
        self.latency_sum_ns = self.latency_sum_ns.saturating_add(o.latency_sum_ns);
    }

    /// The latency below which `q` (0..=1) of the completions fall, as the
    /// upper bound of its bucket (`None` without completions; `u64::MAX`
    /// for the +Inf bucket).
    pub fn latency_quantile_us(&self, q: f64) -> Option<u64> {
        let total: u64 = self.latency_buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q.clamp(0.0, 1.0)).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.latency_buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(LATENCY_BOUNDS_US.get(i).copied().unwrap_or(u64::MAX));
            }
        }
        Some(u64::MAX)
    }
}

/// A connection's (or, merged, a server's) request counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestStats {
    /// By opcode, in the order of [`OPCODES`] ([`op_index`]).
    pub ops: [OpStats; OPCODES.len()],
    /// Answers with a status other than STATUS_SUCCESS, by status.
    pub errors: BTreeMap<NtStatus, u64>,
    /// LWIO_FRAGMENT messages received (docs/protocol.md §5.12).
    pub fragments: u64,
    /// Fragmented messages put back together (each also counts once as a
    /// request of its opcode).
    pub messages_reassembled: u64,
}

impl RequestStats {
    pub fn op(&self, op: Opcode) -> &OpStats {
        &self.ops[op_index(op)]
    }

    pub(crate) fn received(&mut self, op: Opcode) {
        self.ops[op_index(op)].requests += 1;
    }

    /// A request of `op` answered with `status` after `latency`, having
    /// moved `bytes` data bytes.
    pub(crate) fn completed(
        &mut self,
        op: Opcode,
        status: NtStatus,
        latency: Duration,
        bytes: u32,
    ) {
        let bytes = if status == STATUS_SUCCESS { bytes } else { 0 };
        self.ops[op_index(op)].observe(latency, bytes);
        if status != STATUS_SUCCESS {
            *self.errors.entry(status).or_default() += 1;
        }
    }

    /// Add `o`'s counts to these.
    pub fn merge(&mut self, o: &RequestStats) {
        for (a, b) in self.ops.iter_mut().zip(&o.ops) {
            a.merge(b);
        }
        for (s, n) in &o.errors {
            *self.errors.entry(*s).or_default() += n;
        }
        self.fragments += o.fragments;
        self.messages_reassembled += o.messages_reassembled;
    }

    pub fn is_empty(&self) -> bool {
        *self == RequestStats::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_quantiles_and_merge() {
        let mut s = RequestStats::default();
        s.received(Opcode::Read);
        s.completed(Opcode::Read, STATUS_SUCCESS, Duration::from_micros(5), 4096);
        s.received(Opcode::Read);
        s.completed(Opcode::Read, STATUS_SUCCESS, Duration::from_micros(6), 100);
        s.received(Opcode::Read);
        s.completed(Opcode::Read, 0xC000_0011, Duration::from_secs(2), 4096);
        let r = s.op(Opcode::Read);
        assert_eq!((r.requests, r.completed, r.bytes), (3, 3, 4196));
        // 5 µs is in the first bucket (≤ 5), 6 µs in the second, 2 s in +Inf.
        assert_eq!(r.latency_buckets[0], 1);
        assert_eq!(r.latency_buckets[1], 1);
        assert_eq!(r.latency_buckets[LATENCY_BOUNDS_US.len()], 1);
        assert_eq!(r.latency_sum_ns, 2_000_011_000);
        assert_eq!(r.latency_quantile_us(0.3), Some(5));
        assert_eq!(r.latency_quantile_us(0.5), Some(10));
        assert_eq!(r.latency_quantile_us(0.99), Some(u64::MAX));
        assert_eq!(s.errors.get(&0xC000_0011), Some(&1));
        let mut t = RequestStats::default();
        t.merge(&s);
        t.merge(&s);
        assert_eq!(t.op(Opcode::Read).bytes, 2 * 4196);
        assert_eq!(t.errors.get(&0xC000_0011), Some(&2));
        assert_eq!(t.op(Opcode::Write), &OpStats::default());
        assert_eq!(
            RequestStats::default()
                .op(Opcode::Read)
                .latency_quantile_us(0.5),
            None
        );
    }
}

#[cfg(test)]
mod index_tests {
    use super::*;

    #[test]
    fn every_opcode_has_its_own_slot() {
        for (i, op) in OPCODES.iter().enumerate() {
            assert_eq!(op_index(*op), i, "{op:?}");
        }
    }
}
