//! The sans-IO software RNIC of Softwarp: protection domains, memory registrations and the
//! STag table, completion queues, shared receive queues, and queue pairs that run RDMAP
//! (RFC 5040) over DDP (RFC 5041) over MPA (RFC 5044, RFC 6581).
//!
//! This crate never does I/O: no sockets, no threads, no sleeping, and it never reads a
//! clock (time comes in as the instants the runtime passes to a QP's clock). The runtime
//! (crate `softwarp`) owns the TCP connection and moves bytes; the engine makes every
//! protocol decision. All wire formats come from `softwarp-wire`. Memory is allocated when a
//! resource is created (queues are fixed-capacity rings); the data path does not allocate.
//!
//! # Resources
//!
//! - [`memory::Region`]: memory shared with the network. Owned regions are zeroed and
//!   page-aligned; raw regions wrap FFI memory (`unsafe fn from_raw`). Access goes through
//!   bounds-checked relaxed atomic loads and stores (never a slice over the bytes: the
//!   module docs state the memory model); the runtime gets raw pointers for `readv`/`writev`.
//!   This is the only module with `unsafe` code.
//! - [`mr::MrTable`]: registrations by STag (`index << 8 | key`, unpredictable key rotated on
//!   every reuse, no repeat within a cycle of 256, never STag 0 or 1), VA-based tagged offsets, [`mr::MrTable::validate`]
//!   naming exactly which check failed, local and remote invalidation, deregistration refused
//!   while in-flight work holds the registration.
//! - [`cq::Cq`]: fixed ring of [`wr::WorkCompletion`]s; overflow puts the CQ in error, queues
//!   [`event::AsyncEvent::CqError`] and hands the completion back (never dropped silently).
//! - [`srq::Srq`]: shared receive queue with the armed limit event.
//! - [`qp::Qp`]: one reliable connection.
//! - [`mpa`]: MPA connection setup as pure functions (RFC 5044, RFC 6581): the initiator's
//!   Request and its check of the Reply, the responder's screening and Reply, and what the
//!   exchange settles ([`mpa::Negotiated::stream_config`], the QP's [`qp::StreamConfig`]).
//!   The runtime moves the frames.
//!
//! # Driving a QP
//!
//! Operations: Send (with SE, with Invalidate), RDMA Write, RDMA Read (RFC 5040), Write and
//! Send with Immediate, FetchAdd and CmpSwap (RFC 7306); MPA CRC and markers (RFC 5044),
//! the RFC 6581 RTR.
//!
//! Methods are grouped like quinn-proto's `Connection`: getters; `handle_*` inputs;
//! application commands (`establish`, `post_send`, `post_recv`, `modify`, `destroy`); and
//! `poll_*` outputs.
//!
//! ```text
//! create:     Qp::new(QpConfig)                       -> Idle; post_recv allowed
//! connected:  qp.establish(negotiated.stream_config(mss, &offer)) -> RTS (mpa module)
//! receive:    qp.recv_from(&mut reader, stage, &mut budget, until, &mut mrs_and_srq)
//! transmit:   qp.send_to(&mut writer, Some(&mut batch), &mut budget)
//! outputs:    while let Some((cq, wc)) = qp.poll_completion() { push to the send or recv CQ }
//!             while let Some(ev) = qp.poll_event() { report }
//! timers:     qp.set_timers(timers, now) once established; sleep until qp.poll_timeout(),
//!             then qp.handle_timeout(now) (true: the polling order again)
//! ```
//!
//! The data path has these two entry points, one per direction ([`qp::Qp::recv_from`],
//! [`qp::Qp::send_to`]); the caller supplies a vectored reader ([`qp::VectoredRead`],
//! `readv`-like: the engine's target, then a staging buffer; or three buffers for an early
//! read of a Send's payload, staging around the posted receive) and writer
//! ([`qp::VectoredWrite`], `sendmsg`-like gather), and the engine decides everything else:
//! where each byte goes, read-ahead and the whole-FPDU and small-Send fast paths,
//! coalescing of small FPDUs into the caller's batch buffer, and the responder's "nothing
//! before the peer's first FPDU" gate (RFC 5044 and RFC 6581). The runtime implements the
//! traits over its socket, the tests over byte slices cut in 1-byte and random pieces, so
//! both run the same code. Region memory reaches a reader only as a [`qp::ReadDest::Region`]
//! (a region, offset and length): a reader hands it to the kernel through
//! [`memory::Region::ptr_range`] or copies with [`memory::Region::write_at`].
//!
//! Polling order after any input (received bytes, a post, a state change): `send_to` (the
//! Terminate of an error is sent this way, and after it [`qp::Qp::terminate_sent`] tells the
//! runtime to close the connection), then `poll_completion` until `None`, then `poll_event`
//! until `None`. Completions must be drained before more data can be received when the QP
//! holds as many receives as it may (`recv_from` ends with [`qp::RecvEnd::Blocked`]).
//! `handle_rx`/`handle_tx` are copying conveniences over the same two entry points, for
//! tests and simple runtimes. TCP closing or failing is reported with
//! [`qp::Qp::handle_llp_closed`]. The time-based rules (the receive stall, the first-FPDU
//! hold) are the QP's own decisions from the instants it is given: see the `qp` module's
//! "Sub-state machines and the clock".
//!
//! # Receive path
//!
//! Each FPDU is read in three steps: the header into a small buffer inside the QP (the MPA
//! length and the two control bytes first, then the rest of the header they imply), the
//! payload straight into its destination (the RDMA Write or Read Response target region, or
//! the receive WR's buffers: never a staging buffer), then pad and CRC. The header is
//! validated before any byte of payload is accepted: STag exists, key matches, not
//! invalidated, PD matches the QP, access rights, TO + length inside the region; MSN and MO
//! for untagged messages; a receive WR is available and large enough; Read Requests within
//! IRD and their source valid. A header that fails places nothing (its payload goes to a
//! scratch buffer) so no byte outside a permitted range is ever written. The one exception
//! to "header first" is the early read of a large Send ([`qp::Qp::recv_from`]): its payload
//! is read into the next posted receive, which the QP owns until it completes, and copied
//! out of it again when the header names something else. The CRC is computed
//! over the bytes as they are placed and checked before anything is delivered (completions,
//! Send with Invalidate, queueing a Read Request, acting on a Terminate); a header error is
//! reported after the CRC check, so a corrupted FPDU is a CRC error.
//!
//! A Send (or Immediate Data) whose header finds no receive posted is held when the QP's
//! clock has an RNR wait ([`qp::Timers::rnr_wait`]): nothing more is read (TCP's flow
//! control then holds the peer back, iWARP's stand-in for InfiniBand's RNR retry), bytes
//! already read ahead past the header are kept in the QP, and [`qp::Qp::recv_from`] ends
//! with [`qp::RecvEnd::NoReceive`] until a receive is posted; past the bound the Send
//! fails as it does without the wait (the no-buffer Terminate, after the CRC check).
//!
//! With MPA markers negotiated for the received direction, every target stops at the next
//! marker position; the marker goes into a 4-byte buffer in the QP, is checked (FPDUPTR),
//! fed to the CRC and dropped, so the payload still goes straight to its destination. A bad
//! marker fails the stream at once (LLP, "marker and ULPDU Length mismatch" Terminate).
//!
//! Placing before the CRC check is what siw does and what zero copy requires; a corrupted
//! payload can reach the destination, but only a destination the (CRC-covered) header was
//! allowed to name, and the message is then never completed: the QP fails with a Terminate
//! (LLP, MPA CRC error) instead.
//!
//! # Transmit path
//!
//! Messages are cut into FPDUs of at most `StreamConfig::max_fpdu_len` bytes (MPA's MULPDU
//! for that EMSS; siw's 1448-byte FPDUs at MTU 1500). An FPDU is offered as gather pieces:
//! the MPA length and DDP/RDMAP header (and inline data) from a buffer in the QP, payload
//! pieces pointing into registered regions, and pad plus CRC (computed over the pieces when
//! the FPDU is built). With markers negotiated for the sent direction the pieces are split at
//! the marker positions the wire crate's `MarkerLayout` gives, the 4-byte markers (kept in
//! the QP) go between them, MULPDU leaves room for them, and the CRC covers them; a gather
//! list longer than [`qp::GATHER_PIECES`] is offered in parts. Markers are negotiated per
//! direction (`StreamConfig::markers_tx`/`markers_rx`; the M bit of an MPA frame asks the
//! other side to send markers) from the stream offsets in the `StreamConfig` (0 for a fresh
//! stream: the first marker precedes the first FPDU). Order: a queued Terminate, the RTR, the
//! message in progress, Read
//! Responses, then send WRs in posting order; an RDMA Read waits while ORD Reads are
//! outstanding, a fenced WR until earlier Reads completed.
//!
//! # Errors
//!
//! Every error the RFCs name produces its Terminate (see [`fault::Fault`] and the QP's
//! terminate module for the mapping and the siw layout option), an asynchronous event with
//! its [`fault::Cause`], the QP moves to Terminate and then Error, and every outstanding WR
//! completes (with the specific status for the WR the error is about, `WrFlushErr` for the
//! rest). A received Terminate moves the QP to Error and completes the RDMA Read it refused
//! with the remote status. Local misuse is a [`qp::QpError`] and leaves the stream alone.
//!
//! # Deliberate deviations from the task design
//!
//! - Local SGEs of send WRs are validated when posted, and the references taken keep the
//!   registration alive and "in use" until completion; so `send_to` needs no STag table. A
//!   WR that fails validation still completes in order, with `LocProtErr`.
//! - `recv_from` takes the STag table and the SRQ through [`qp::RxResources`], asked for only
//!   when a header or trailer completes (validation and Send with Invalidate) and let go
//!   before every read.
//! - RFC 7306: Write/Send with Immediate are the data message followed by an Immediate
//!   Data message (queue 0, next MSN), which consumes a receive WR of its own: after an
//!   RDMA Write it completes as `RecvRdmaWithImm` with the Write's length, otherwise as a
//!   `Recv` of 0 bytes (so Send with Immediate takes two receive WRs at the peer). The verbs
//!   value is 32 bits: it is the low-order half of the 8-byte Immediate Data (big-endian),
//!   the high-order half is sent as zero and ignored on receipt.
//! - RFC 7306 atomics operate on the target word in host byte order, under one process-wide
//!   lock (atomic with respect to every atomic this engine performs, not to plain CPU
//!   accesses by the application); the original value is written to the requester's sink in
//!   host byte order. Requests are sent unmasked (FetchAdd with Add Mask 0, CmpSwap with
//!   full masks); received masks are honoured. A misaligned Remote Tagged Offset is refused
//!   with RDMAP Remote Protection Error "Base or bounds violation" (RFC 7306 defines no code
//!   of its own).
//! - A zero-length RDMA Write is not validated (it places nothing), as in siw; this is what
//!   makes siw's RTR (zero-length Write to STag 1) work.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod cq;
pub mod event;
pub mod fault;
#[allow(unsafe_code)]
pub mod memory;
pub mod mpa;
pub mod mr;
pub mod qp;
pub(crate) mod ring;
pub use ring::{RingGuard, RING_GUARD_HI, RING_GUARD_LO};
pub mod srq;
pub mod stats;
pub mod wr;
