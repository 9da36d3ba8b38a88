//! Context checks: a blocking call made where it would deadlock returns
//! [`Error::WouldDeadlock`] instead of hanging.
//!
//! Where blocking deadlocks (or stalls everything until a timeout):
//!
//! - on a device's **progress thread**: it moves the bytes, completions and events that
//!   every wait of the device is waiting for (a CQ event, a connection's close, a
//!   registration's release), and Softwarp runs code of the application there: its
//!   `tracing` subscriber (records emitted by the progress thread) and the drop of objects
//!   whose last reference the progress thread holds;
//! - on a connection manager's **event channel thread**: it makes the events that
//!   `CmEventChannel::get_event` and the blocking connect wait for (same callbacks);
//! - **inside an entry point** of a device on the calling thread (a `tracing` callback of
//!   a record emitted inside `CompletionQueue::poll` or `QueuePair::post_send`, with the
//!   QP's or CQ's lock held): the wait may need the lock its own thread holds.
//!
//! The checks are two thread-local reads, made only by the blocking calls (never on the
//! data path): the runtime threads mark themselves when they start, and the in-flight
//! slot ([`crate::availability::inflight`]) says whether the thread is inside an entry point.

use std::cell::Cell;

use crate::availability::inflight::DeviceGate;
pub(crate) use crate::error::BlockingContext;
use crate::error::{Error, Result};

const NONE: u8 = 0;
const PROGRESS: u8 = 1;
const CM: u8 = 2;

thread_local! {
    static RUNTIME_THREAD: Cell<u8> = const { Cell::new(NONE) };
}

/// Marks the calling thread as a device's progress thread (at its start).
pub(crate) fn mark_progress_thread() {
    RUNTIME_THREAD.with(|t| t.set(PROGRESS));
}

/// Marks the calling thread as a connection manager event channel's thread (at its start).
pub(crate) fn mark_cm_thread() {
    RUNTIME_THREAD.with(|t| t.set(CM));
}

/// The context the calling thread is in, if a blocking call would deadlock there.
pub(crate) fn blocking_context() -> Option<BlockingContext> {
    match RUNTIME_THREAD.try_with(Cell::get).unwrap_or(NONE) {
        PROGRESS => return Some(BlockingContext::ProgressThread),
        CM => return Some(BlockingContext::CmThread),
        _ => {}
    }
    DeviceGate::current_entry().map(BlockingContext::InsideCall)
}

/// Refuses the blocking call `call` where it would deadlock.
pub(crate) fn check_blocking(call: &'static str) -> Result<()> {
    match blocking_context() {
        None => Ok(()),
        Some(context) => {
            softwarp_ras::sw_event!(
                Runtime,
                2,
                call,
                "blocking call refused: it would deadlock in {}",
                context
            );
            Err(Error::WouldDeadlock { call, context })
        }
    }
}

/// [`check_blocking`] for a call with a timeout: one that may not wait (`Some(ZERO)`) is
/// not blocking and is always allowed.
pub(crate) fn check_wait(call: &'static str, timeout: Option<std::time::Duration>) -> Result<()> {
    if timeout.is_some_and(|t| t.is_zero()) {
        return Ok(());
    }
    check_blocking(call)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_threads_and_callbacks_are_refused_and_others_are_not() {
        assert!(check_blocking("x").is_ok());
        std::thread::spawn(|| {
            mark_progress_thread();
            let e = check_blocking("CompletionChannel::get_cq_event").unwrap_err();
            assert!(matches!(
                e,
                Error::WouldDeadlock {
                    call: "CompletionChannel::get_cq_event",
                    context: BlockingContext::ProgressThread
                }
            ));
            assert!(e.to_string().contains("progress thread"), "{e}");
            // A call that does not wait is not blocking.
            assert!(check_wait("x", Some(std::time::Duration::ZERO)).is_ok());
            assert!(check_wait("x", None).is_err());
        })
        .join()
        .unwrap();
        std::thread::spawn(|| {
            mark_cm_thread();
            assert!(matches!(
                check_blocking("x"),
                Err(Error::WouldDeadlock {
                    context: BlockingContext::CmThread,
                    ..
                })
            ));
        })
        .join()
        .unwrap();
        let gate = DeviceGate::new();
        let inside = gate
            .enter(crate::availability::inflight::Entry::Poll)
            .unwrap();
        assert!(matches!(
            check_blocking("x"),
            Err(Error::WouldDeadlock {
                context: BlockingContext::InsideCall("CompletionQueue::poll"),
                ..
            })
        ));
        drop(inside);
        assert!(check_blocking("x").is_ok());
    }
}
