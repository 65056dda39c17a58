//! Affiliated asynchronous events of QPs (`ibv_get_async_event`): how a
//! verbs device tells its consumer that it refused the peer's traffic.
//!
//! When a peer RDMA-Writes through a key, range or right this side did not
//! grant, the device (the responder) refuses it — siw with a Terminate,
//! rxe with a NAK — and puts the QP in the error state; the completions say
//! only "flushed". Some refusals also raise `IBV_EVENT_QP_ACCESS_ERR` (an
//! invalid request: `IBV_EVENT_QP_REQ_ERR`) on the context's async fd:
//! measured in the VM suite (Debian's 6.1 kernel), siw raises it for a
//! Write outside a key's range, and neither siw for a key that is not valid
//! (any more) nor rxe for any refusal raises anything. The events
//! are read on demand, when the consumer asks why its QP failed
//! ([`qp_refusal`]): the fd is made non-blocking and drained, each event is
//! acknowledged at once (`ibv_destroy_qp` waits for the acknowledgement of
//! every event it was given), and QP errors are kept by QP until that QP is
//! destroyed ([`forget_qp`]). Nothing else in lwio reads the async fd.
//!
//! The contexts are librdmacm's (`rdma_get_devices`), one per device and
//! shared by every lwio context of the process; so is this table.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::ffi::*;
use super::lock;

#[derive(Default)]
struct Table {
    /// Contexts whose async fd was made non-blocking (by address).
    nonblocking: HashSet<usize>,
    /// The error event each QP (by `ibv_qp` address) reported.
    qp_errors: HashMap<usize, i32>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// Read and acknowledge every pending event of `ctx`, keeping QP errors.
fn drain(lib: &Lib, ctx: *mut ibv_context, t: &mut Table) {
    if t.nonblocking.insert(ctx as usize) {
        // SAFETY: `ctx` is a live context (the caller holds the device
        // list); F_GETFL/F_SETFL on its async fd change only that fd's
        // blocking mode, which nothing else in the process relies on.
        unsafe {
            let fd = (*ctx).async_fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
                t.nonblocking.remove(&(ctx as usize));
                return;
            }
        }
    }
    loop {
        let mut ev = ibv_async_event {
            element: std::ptr::null_mut(),
            event_type: 0,
        };
        // SAFETY: live context, non-blocking async fd: returns 0 with `ev`
        // filled, or -1 (EAGAIN) when no event is pending.
        if unsafe { (lib.ibv_get_async_event)(ctx, &mut ev) } != 0 {
            break;
        }
        tracing::debug!(event = ev.event_type, element = ?ev.element, "verbs async event");
        match ev.event_type {
            IBV_EVENT_QP_FATAL | IBV_EVENT_QP_REQ_ERR | IBV_EVENT_QP_ACCESS_ERR => {
                // The first error a QP reports is its cause.
                t.qp_errors
                    .entry(ev.element as usize)
                    .or_insert(ev.event_type);
            }
            _ => {}
        }
        // SAFETY: `ev` came from ibv_get_async_event and is acknowledged
        // once.
        unsafe { (lib.ibv_ack_async_event)(&mut ev) };
    }
}

/// Why the device put `qp` (of `ctx`) in error, if it said: the event type.
pub(super) fn qp_refusal(lib: &Lib, ctx: *mut ibv_context, qp: *mut ibv_qp) -> Option<i32> {
    let mut g = lock(&TABLE);
    let t = g.get_or_insert_with(Table::default);
    drain(lib, ctx, t);
    t.qp_errors.get(&(qp as usize)).copied()
}

/// `qp` was destroyed: its events are gone with it (the kernel drops those
/// not yet read), and its address may serve another QP.
pub(super) fn forget_qp(qp: *mut ibv_qp) {
    if let Some(t) = lock(&TABLE).as_mut() {
        t.qp_errors.remove(&(qp as usize));
    }
}
