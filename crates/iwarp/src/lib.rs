//! # lwio-iwarp: the IETF iWARP stack as pure, sans-IO Rust
//!
//! MPA (RFC 5044 + RFC 6581), DDP (RFC 5041) and RDMAP (RFC 5040) wire
//! formats and protocol state machines, wire-compatible with Linux siw
//! (`drivers/infiniband/sw/siw`). No sockets, no threads, no clocks: the
//! caller (lwio's soft RDMA provider, `lwio_rdma::soft`) owns the TCP
//! socket, the memory tables and the queue pairs, and calls into this
//! crate with bytes, `Instant`s and a [`rx::Placement`] implementation.
//!
//! ## Modules
//!
//! * [`wire`]: zero-copy `Packet<T>` views and parsed `Repr`s for every
//!   header (MPA frames and FPDUs, DDP tagged/untagged, RDMAP Read Request
//!   and Terminate), plus every Terminate (layer, etype, ecode) value in
//!   [`wire::term`].
//! * [`mpa`]: [`mpa::MpaHandshake`], connection setup for initiator and
//!   responder: CRC, markers (always off), enhanced mode (IRD/ORD), P2P
//!   RTR, reject with private data, timeout.
//! * [`fpdu_rx`]: [`fpdu_rx::FpduReceiver`], the incremental deframer with
//!   bounded memory and zero-copy payload hand-off.
//! * [`rx`]: DDP/RDMAP receive semantics ([`rx::DdpRxState`]), the
//!   [`rx::Placement`] trait and the [`rx::RdmapReceiver`] driver.
//! * [`tx`]: [`tx::TxState`] / [`tx::Segmenter`], which cut a message
//!   into DDP segments sized like siw does and build header/trailer bytes
//!   for a `writev`.
//!
//! ## How the soft provider drives it
//!
//! ```text
//! connect()/accept() TCP
//!   MpaHandshake::initiator(cfg, pdata, now) | ::responder(cfg, now)
//!   loop: write poll_transmit(); n = receive(bytes, now); poll_event();
//!         handle_timeout(now) at poll_timeout()
//!   responder: on ConnectRequest → accept(pdata, ird, ord) or reject(pdata)
//!   → Established(Negotiated { crc, ird, ord, rtr, .. });
//!     bytes after the n consumed are the FPDU stream.
//!   P2P initiator: send negotiated.rtr_message() first (payload 0).
//! RDMA mode
//!   rx: RdmapReceiver::new(FpduConfig { crc, .. });
//!       receive(bytes, &mut placement)   // your memory tables
//!       Err(e) → send e.terminate via TxState (unless a Terminate was
//!                received), then close.
//!   tx: TxState::segment(&TxConfig::from_emss(mss, crc), &msg, len)
//!       for seg: writev(seg.header(), payload[seg range], seg.trailer(..))
//! ```
//!
//! All parsing of remote input is panic-free (no unchecked indexing on
//! parsed lengths, checked arithmetic), and this crate has no `unsafe`.
//! See `README.md` for where siw deviates from the RFCs.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fpdu_rx;
pub mod mpa;
pub mod rx;
pub mod tx;
pub mod wire;
