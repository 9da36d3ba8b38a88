//! Completion queues and completion channels (after `ibv_cq` and `ibv_comp_channel`).
//!
//! Polling mode: [`CompletionQueue::poll`] copies completions into a slice
//! ([`CompletionQueue::poll_with`] hands them to a closure). Event mode: a CQ
//! created with a [`CompletionChannel`] and armed with [`CompletionQueue::req_notify`]
//! signals the channel's file descriptor (an eventfd) at its next completion (or next
//! solicited or error completion); [`CompletionChannel::get_cq_event`] waits for it and says
//! which CQ fired. A CQ that overflows enters an error state, reports
//! [`crate::AsyncEvent::CqError`] on the device's event stream, and the QPs that use it go to the
//! Error state (as verbs do on a CQ overrun).

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use softwarp_engine::cq::{Cq, CqError, CqId};
use softwarp_engine::wr::{WcOpcode, WcStatus, WorkCompletion};
use softwarp_ras::deadline::Deadline;
use softwarp_ras::markers::MarkerWord;
use softwarp_ras::sw_event;
use softwarp_ras::tracker::{DescribeResource, ResourceKind};

use crate::availability::inflight::Entry;
use crate::availability::markers;
use crate::error::{Error, Result};
use crate::instrument::Tracked;
use crate::runtime::sys;
use crate::sync::lock;
use crate::verbs::device::{CountGuard, Counts, DeviceShared};
use crate::verbs::qp::QpShared;

/// A blank completion, to initialise the slice given to [`CompletionQueue::poll`].
pub const EMPTY_COMPLETION: WorkCompletion = WorkCompletion {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    qp_num: 0,
    invalidated_stag: None,
    solicited: false,
    imm: None,
};

#[derive(Debug)]
struct CqState {
    cq: Cq,
    /// Armed for the next completion: `Some(solicited_only)`.
    armed: Option<bool>,
    /// Statistics: completions queued, of them with an error status, taken by the
    /// application, channel notifications.
    completions: u64,
    error_completions: u64,
    polled: u64,
    notifications: u64,
    /// Sleeps of threads that kept polling while nothing came
    /// ([`CompletionQueue::set_idle_sleep`]).
    idle_sleeps: u64,
}

thread_local! {
    /// Polls in a row on this thread that found their CQ empty, whichever CQs they were:
    /// a thread that takes completions from one CQ while it also polls one that stays empty
    /// (unsignaled sends) is not idle ([`CqShared::after_poll`]).
    static EMPTY_RUN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Polls in a row that find a CQ empty before the polling thread starts giving its core away
/// ([`CompletionQueue::set_idle_sleep`]): about 3 ms of spinning (an empty poll takes 11 ns
/// on the test VM, release build), longer than any round trip of a message up to 1 MiB.
pub const IDLE_SPIN_POLLS: u32 = 262_144;
/// After [`IDLE_SPIN_POLLS`], one sleep of [`IDLE_SLEEP`] every this many empty polls.
const IDLE_SLEEP_EVERY: u32 = 1024;
/// How long a poller that found its CQ empty for a long time sleeps at a time.
pub const IDLE_SLEEP: std::time::Duration = std::time::Duration::from_micros(100);

/// `repr(C)`: the structure markers begin and end it.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct CqShared {
    begin: markers::Begin,
    device: Arc<DeviceShared>,
    state: Mutex<CqState>,
    channel: Option<Arc<ChannelShared>>,
    /// QPs that complete into this CQ (moved to Error on overflow; driven by busy polls).
    pub(crate) qps: crate::verbs::device::WeakList<QpShared>,
    count: Mutex<CountGuard>,
    /// The CQ's number, reserved while it lives.
    _number: crate::verbs::device::IdLease,
    /// The registration, owned by the application's [`CompletionQueue`] handles (the
    /// lingering connection of a destroyed QP keeps this state alive, not them).
    ras: Weak<Tracked>,
    /// Busy-poll mode: [`CompletionQueue::poll`] moves the bytes of the QPs that receive
    /// into this CQ, and their sockets do not wake the progress thread for reading.
    pub(crate) busy_poll: AtomicBool,
    /// [`CompletionQueue::set_idle_sleep`] (on by default).
    idle_sleep: AtomicBool,
    end: markers::End,
}

impl Drop for CqShared {
    fn drop(&mut self) {
        self.device.cqs.died();
        lock(&self.count).release(&self.device.counts.cq);
    }
}

impl CqShared {
    /// Queues the completions `next` yields (runtime side), under one lock of the CQ: notifies
    /// the channel when armed; on overflow reports the CQ error and has the progress thread
    /// move this CQ's QPs to Error (both once the lock is released). `next` runs under the
    /// CQ lock: it must not take another CQ's.
    pub(crate) fn push_all(self: &Arc<Self>, mut next: impl FnMut() -> Option<WorkCompletion>) {
        let Some(first) = next() else {
            return;
        };
        let mut notify = false;
        let mut overflow = None;
        let mut st = lock(&self.state);
        let mut wc = Some(first);
        while let Some(c) = wc {
            match st.cq.push(c) {
                Ok(()) => {
                    st.completions += 1;
                    if c.status != WcStatus::Success {
                        st.error_completions += 1;
                    }
                    if let Some(solicited_only) = st.armed {
                        let fire = !solicited_only
                            || c.status != WcStatus::Success
                            || (c.opcode == WcOpcode::Recv && c.solicited);
                        if fire {
                            st.armed = None;
                            st.notifications += 1;
                            notify = true;
                        }
                    }
                }
                Err(CqError::Overflow { .. }) => overflow = Some((c.wr_id, st.cq.poll_event())),
                Err(_) => {
                    // Already in error: the overflow was reported once; this completion is
                    // lost with it (counted by the engine CQ's `refused`).
                }
            }
            wc = next();
        }
        drop(st);
        if notify {
            if let Some(ch) = &self.channel {
                ch.notify(self);
            }
        }
        if let Some((wr_id, ev)) = overflow {
            tracing::error!(cq = ?self.id(), wr_id, "completion queue overflow");
            if let Some(ev) = ev {
                self.device.events.push(ev);
            }
            let cq = Arc::clone(self);
            self.device.progress.cq_overflow(move || cq.qps());
        }
    }

    pub(crate) fn id(&self) -> CqId {
        lock(&self.state).cq.id()
    }

    pub(crate) fn add_qp(&self, qp: &Arc<QpShared>) {
        self.qps.insert(qp, &self.device.progress.counters);
    }

    /// Completions the application took from this CQ so far (statistics; the progress
    /// thread's busy-poll receive look tells from it whether the application still polls).
    pub(crate) fn polled(&self) -> u64 {
        lock(&self.state).polled
    }

    pub(crate) fn qps(&self) -> Vec<Arc<QpShared>> {
        self.qps.live()
    }

    /// Busy poll: one non-blocking progress pass (receive, transmit, completions) over the
    /// QPs of this CQ that no other thread is servicing right now. Never blocks: a QP whose
    /// lock is taken is skipped (its owner is moving its bytes). Called without the CQ's
    /// own lock (the pass pushes completions).
    fn drive(&self) {
        let qps = self.qps.lock();
        for qp in qps.iter().filter_map(Weak::upgrade) {
            let _ = qp.busy_pass();
        }
    }

    /// Whether the CQ's begin and end words are intact (two loads).
    #[inline]
    fn markers_intact(&self) -> bool {
        markers::intact(markers::Kind::Cq, &self.begin, &self.end)
    }

    /// The CQ's markers and the guard words of its ring, as found (takes the CQ lock).
    pub(crate) fn marker_words(&self) -> Vec<MarkerWord> {
        let mut words = markers::words(markers::Kind::Cq, &self.begin, &self.end);
        words.extend(markers::ring_words(&[lock(&self.state).cq.ring_guard()]));
        words
    }

    /// Checks every marker of the CQ; a damaged one fails the device. Call with no lock
    /// held.
    pub(crate) fn check_markers(&self, check: &'static str) -> Result<()> {
        if self.marker_words().iter().all(MarkerWord::is_intact) {
            return Ok(());
        }
        Err(self.markers_damaged(check))
    }

    /// Reports damaged markers (fails the device). Call with no lock held.
    #[cold]
    #[inline(never)]
    fn markers_damaged(&self, check: &'static str) -> Error {
        let words = self.marker_words();
        let id = lock(&self.state).cq.id().0;
        markers::damaged(
            &*self.device,
            markers::Kind::Cq.name(),
            u64::from(id),
            &words,
            check,
        )
    }

    /// After a poll that took `n` completions (the state still locked): counts the polls
    /// on this thread that found their CQ empty in a row ([`EMPTY_RUN`]), and past
    /// [`IDLE_SPIN_POLLS`] of them sleeps [`IDLE_SLEEP`] every [`IDLE_SLEEP_EVERY`]
    /// (unlocked), unless this CQ is busy-polled or [`CompletionQueue::set_idle_sleep`] is
    /// off.
    #[inline]
    fn after_poll(&self, mut st: MutexGuard<'_, CqState>, n: usize) {
        let run = if n > 0 {
            0
        } else {
            EMPTY_RUN.with(|r| r.get()).wrapping_add(1)
        };
        EMPTY_RUN.with(|r| r.set(run));
        if run < IDLE_SPIN_POLLS
            || !run.is_multiple_of(IDLE_SLEEP_EVERY)
            || self.busy_poll.load(Ordering::Relaxed)
            || !self.idle_sleep.load(Ordering::Relaxed)
        {
            return;
        }
        st.idle_sleeps += 1;
        drop(st);
        std::thread::sleep(IDLE_SLEEP);
    }

    /// Counters and state for RAS (statistics, `softwarp resources`).
    pub(crate) fn ras_view(&self) -> CqView {
        let st = lock(&self.state);
        CqView {
            id: st.cq.id().0,
            capacity: st.cq.capacity(),
            len: st.cq.len(),
            in_error: st.cq.is_error(),
            refused: st.cq.refused(),
            completions: st.completions,
            error_completions: st.error_completions,
            polled: st.polled,
            notifications: st.notifications,
            idle_sleeps: st.idle_sleeps,
            channel: self.channel.is_some(),
        }
    }
}

/// What RAS reports about a CQ, copied under its lock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CqView {
    pub(crate) id: u32,
    pub(crate) capacity: usize,
    pub(crate) len: usize,
    pub(crate) in_error: bool,
    pub(crate) refused: u64,
    pub(crate) completions: u64,
    pub(crate) error_completions: u64,
    pub(crate) polled: u64,
    pub(crate) notifications: u64,
    pub(crate) idle_sleeps: u64,
    pub(crate) channel: bool,
}

/// A completion queue. Cloning gives another handle to the same CQ.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) shared: Arc<CqShared>,
    /// Registered with the device's tracker while the application holds a handle.
    _ras: Option<Arc<Tracked>>,
}

impl CompletionQueue {
    #[track_caller]
    pub(crate) fn new(
        device: &Arc<DeviceShared>,
        cqe: usize,
        channel: Option<&CompletionChannel>,
    ) -> Result<Self> {
        if cqe == 0 {
            return Err(Error::InvalidArgument("a CQ needs at least one entry"));
        }
        if cqe > device.attr.max_cqe {
            return Err(Error::Limit {
                what: "CQ entries",
                requested: cqe,
                limit: device.attr.max_cqe,
            });
        }
        let count = Counts::take(&device.counts.cq, device.attr.max_cq, "completion queues")?;
        let number = device.next_id()?;
        let id = CqId(number.id());
        let bytes = std::mem::size_of::<CqShared>() + cqe * std::mem::size_of::<WorkCompletion>();
        let ras = Arc::new(Tracked::new(
            &device.ras.tracker,
            ResourceKind::Cq,
            u64::from(id.0),
            bytes as u64,
        ));
        let shared = Arc::new(CqShared {
            begin: markers::Begin::new(markers::Kind::Cq),
            device: Arc::clone(device),
            state: Mutex::new(CqState {
                cq: Cq::new(id, cqe),
                armed: None,
                completions: 0,
                error_completions: 0,
                polled: 0,
                notifications: 0,
                idle_sleeps: 0,
            }),
            channel: channel.map(|c| Arc::clone(&c.shared)),
            qps: crate::verbs::device::WeakList::default(),
            count: Mutex::new(count),
            _number: number,
            ras: Arc::downgrade(&ras),
            busy_poll: AtomicBool::new(false),
            idle_sleep: AtomicBool::new(true),
            end: markers::End::new(markers::Kind::Cq),
        });
        ras.describe_with(Arc::downgrade(&shared) as Weak<dyn DescribeResource>);
        device.cqs.insert(&shared, &device.progress.counters);
        sw_event!(Cq, 4, cq = id.0, cqe, "CQ created");
        Ok(Self {
            shared,
            _ras: Some(ras),
        })
    }

    /// Another handle to the CQ of `shared`.
    fn from_shared(shared: Arc<CqShared>) -> Self {
        Self {
            _ras: shared.ras.upgrade(),
            shared,
        }
    }

    pub(crate) fn device(&self) -> &Arc<DeviceShared> {
        &self.shared.device
    }

    /// The CQ's id (as reported in [`crate::AsyncEvent::CqError`]).
    pub fn id(&self) -> CqId {
        self.shared.id()
    }

    /// Capacity in completions.
    pub fn capacity(&self) -> usize {
        lock(&self.shared.state).cq.capacity()
    }

    /// Completions waiting to be polled. (`#[inline]`, as [`CompletionQueue::is_empty`]:
    /// called by [`CompletionQueue::poll_with`], whose instances live in other crates.)
    #[inline]
    pub fn len(&self) -> usize {
        lock(&self.shared.state).cq.len()
    }

    /// Changes the capacity to `cqe` completions (`ibv_resize_cq`), keeping those waiting,
    /// in order. [`Error::InvalidArgument`] for 0 or fewer than the completions waiting (the
    /// CQ is unchanged), [`Error::Limit`] above the device's `max_cqe`. The completions
    /// arriving meanwhile wait for the CQ's lock; a CQ in error after an overflow stays in
    /// error.
    pub fn resize(&self, cqe: usize) -> Result<()> {
        let sh = &self.shared;
        if cqe == 0 {
            return Err(Error::InvalidArgument("a CQ needs at least one entry"));
        }
        if cqe > sh.device.attr.max_cqe {
            return Err(Error::Limit {
                what: "CQ entries",
                requested: cqe,
                limit: sh.device.attr.max_cqe,
            });
        }
        lock(&sh.state).cq.resize(cqe).map_err(|_| {
            Error::InvalidArgument("more completions wait than the new capacity holds")
        })?;
        if let Some(ras) = sh.ras.upgrade() {
            let bytes =
                std::mem::size_of::<CqShared>() + cqe * std::mem::size_of::<WorkCompletion>();
            ras.handle().set_bytes(bytes as u64);
        }
        Ok(())
    }

    /// True when no completion waits.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes the completions of the QP numbered `qp_num` that wait in this CQ, those of
    /// other QPs keeping their order; returns how many went. For the C ABI's
    /// `ibv_destroy_qp`: rdma-core's providers (mlx5, mlx4, irdma) clean a destroyed QP's
    /// completions out of its CQs, and middleware relies on it (libfabric's verbs provider
    /// reports every work request still outstanding at a destroy as flushed and frees the
    /// endpoint, so a completion of that QP polled afterwards names freed memory). A
    /// [`QueuePair`](crate::QueuePair) dropped in Rust leaves its completions (the flushed
    /// ones too) for the application to poll.
    pub fn discard_qp(&self, qp_num: u32) -> usize {
        let mut st = lock(&self.shared.state);
        let gone = st.cq.discard_qp(qp_num);
        if gone > 0 {
            sw_event!(
                Cq,
                5,
                qpn = qp_num,
                cq = st.cq.id().0,
                gone,
                "completions of a destroyed QP discarded"
            );
        }
        gone
    }

    /// Moves up to `wcs.len()` completions, oldest first, into `wcs`; returns how many.
    ///
    /// Completions queued before an overflow are still returned; once they are gone, a CQ
    /// that overflowed returns [`Error::CqOverflowed`].
    ///
    /// After [`crate::Device::close`] (or while the device is quiesced) a poll still
    /// returns what is queued (the completions the close flushed) but moves no bytes.
    /// [`Error::MarkerDamaged`] when the CQ's structure markers are damaged (the device
    /// failed).
    pub fn poll(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_each(wcs.iter_mut(), |slot, wc| *slot = wc)
    }

    /// Takes up to `max` completions, oldest first, handing each to `f`; returns how many.
    /// The same as [`CompletionQueue::poll`] (errors, busy polling, closed devices) for a
    /// caller that stores completions in a form of its own (a C `ibv_wc` array, a ring): no
    /// slice of [`WorkCompletion`]s in between.
    ///
    /// `f` runs with the CQ locked: it must not call into Softwarp (on this thread, that
    /// would deadlock), only store or look at the completion.
    pub fn poll_with(&self, max: usize, mut f: impl FnMut(WorkCompletion)) -> Result<usize> {
        self.poll_each(0..max, |_, wc| f(wc))
    }

    /// [`CompletionQueue::poll`] and [`CompletionQueue::poll_with`]: a completion for each
    /// of `slots` while there are any, handed to `f` with its slot.
    #[inline(always)]
    fn poll_each<S>(
        &self,
        slots: impl ExactSizeIterator<Item = S>,
        mut f: impl FnMut(S, WorkCompletion),
    ) -> Result<usize> {
        let max = slots.len();
        let sh = &self.shared;
        let inside = sh.device.inflight.enter(Entry::Poll);
        if !sh.markers_intact() {
            return Err(sh.markers_damaged("CompletionQueue::poll"));
        }
        if inside.is_ok() && sh.busy_poll.load(Ordering::Relaxed) && self.is_empty() {
            sh.drive();
        }
        let mut st = lock(&sh.state);
        if !st.cq.guards_intact() {
            drop(st);
            return Err(sh.markers_damaged("CompletionQueue::poll"));
        }
        let mut n = 0;
        for slot in slots {
            match st.cq.poll() {
                Some(wc) => {
                    f(slot, wc);
                    n += 1;
                }
                None => break,
            }
        }
        if n == 0 && st.cq.is_error() && max > 0 {
            return Err(Error::CqOverflowed {
                capacity: st.cq.capacity(),
            });
        }
        st.polled += n as u64;
        if n > 0 {
            sw_event!(Cq, 7, cq = st.cq.id().0, n, "poll");
        }
        if max > 0 {
            sh.after_poll(st, n);
        }
        Ok(n)
    }

    /// Why the CQ is in error: it overflowed, or its device failed (its QPs' work requests
    /// complete here with a flush status, which polling still returns). `None` while it is
    /// usable.
    pub fn error_reason(&self) -> Option<crate::availability::recovery::CqErrorReason> {
        {
            let st = lock(&self.shared.state);
            if st.cq.is_error() {
                return Some(crate::availability::recovery::CqErrorReason::Overflow {
                    capacity: st.cq.capacity(),
                });
            }
        }
        crate::availability::recovery::device_failure(&self.shared.device.health)
            .map(crate::availability::recovery::CqErrorReason::DeviceFault)
    }

    /// Takes the oldest completion, if any.
    ///
    /// As [`CompletionQueue::poll`] after a close; `None` when the CQ's structure markers
    /// are damaged (the device failed: a `DeviceFatal` event says so).
    pub fn poll_one(&self) -> Option<WorkCompletion> {
        let sh = &self.shared;
        let inside = sh.device.inflight.enter(Entry::PollOne);
        if !sh.markers_intact() {
            sh.markers_damaged("CompletionQueue::poll_one");
            return None;
        }
        if inside.is_ok() && sh.busy_poll.load(Ordering::Relaxed) && self.is_empty() {
            sh.drive();
        }
        let mut st = lock(&sh.state);
        if !st.cq.guards_intact() {
            drop(st);
            sh.markers_damaged("CompletionQueue::poll_one");
            return None;
        }
        let wc = st.cq.poll();
        if let Some(wc) = &wc {
            st.polled += 1;
            sw_event!(
                Cq,
                7,
                qpn = wc.qp_num,
                cq = st.cq.id().0,
                wr_id = wc.wr_id,
                status = ?wc.status,
                "poll_one"
            );
        }
        sh.after_poll(st, usize::from(wc.is_some()));
        wc
    }

    /// Busy-poll mode (off by default): every poll of this CQ that finds it empty first
    /// moves the bytes of the QPs that use it as their receive CQ (reads their sockets,
    /// places data, answers Read Requests, sends what is queued) on the polling thread,
    /// and those QPs' sockets no longer wake the progress thread when data arrives. No
    /// thread wake-up is then on the data path, which is what low latency needs on a
    /// machine where waking a thread on another core costs tens of microseconds.
    ///
    /// A QP whose CQs nobody polls does not stall: when bytes wait unread in its socket for
    /// 10 to 20 ms while the application does nothing on it (no poll, post or completion
    /// taken), the progress thread
    /// takes it over (reads and writes on readiness, as in the default mode) until the
    /// application's polls are back (it reposts receives, or its polls find the bytes
    /// first); likewise a full socket with bytes pending is written by the progress thread
    /// once the polls stop (the write watchdog). Both cost the first message after a pause
    /// up to 20 ms: busy polling is for programs that poll their CQs in a loop. Set it
    /// before connecting the QPs: a QP decides when it connects.
    pub fn set_busy_poll(&self, on: bool) {
        self.shared.busy_poll.store(on, Ordering::Relaxed);
    }

    /// Whether a thread that keeps polling this CQ while nothing comes gives its core away
    /// (on by default): after [`IDLE_SPIN_POLLS`] polls in a row on that thread that found
    /// their CQs empty (about 3 ms of spinning), one poll of this CQ in 1024 sleeps
    /// [`IDLE_SLEEP`] (100 us), until a poll on that thread (of any CQ) takes a completion. Outside busy-poll mode the bytes are moved by the device's progress
    /// thread, and a program that spins on a CQ with nothing coming for a long time (the
    /// passive side of perftest's `ib_write_bw`, spinning on its control CQ for the whole
    /// data phase) would otherwise hold a core that the progress threads and the peer need
    /// on a machine with few cores: `ib_write_bw -s 1M` over the C ABI went from 12-18 to
    /// 33-40 Gbit/s on the 2-CPU test VM. A wait shorter than the spin phase (every
    /// ping-pong, every bandwidth loop that sees completions) never sleeps; a completion
    /// that comes after it is seen up to 100 us late. Busy-poll mode never sleeps (the
    /// polls move the bytes). `false` spins for ever, as hardware RNICs' pollers do.
    pub fn set_idle_sleep(&self, on: bool) {
        self.shared.idle_sleep.store(on, Ordering::Relaxed);
    }

    /// True when [`CompletionQueue::set_idle_sleep`] is on.
    pub fn idle_sleep(&self) -> bool {
        self.shared.idle_sleep.load(Ordering::Relaxed)
    }

    /// True in busy-poll mode ([`CompletionQueue::set_busy_poll`]).
    pub fn busy_poll(&self) -> bool {
        self.shared.busy_poll.load(Ordering::Relaxed)
    }

    /// Fault injection for RAS tests (not for applications): flips one of the CQ's marker
    /// words, `begin`, `end`, `cq.lo` or `cq.hi` (the completion ring's guards). The next
    /// poll (or `Device::close`) sees the damage.
    #[doc(hidden)]
    pub fn damage_marker_for_testing(&self, which: &str) -> Result<()> {
        let s = &self.shared;
        match markers::ring_guard_name(which) {
            Some(("cq", hi)) => {
                lock(&s.state).cq.damage_ring_guard(hi);
                Ok(())
            }
            Some(_) => Err(Error::InvalidArgument("a CQ has one ring, cq")),
            None => markers::damage(&s.begin, &s.end, which),
        }
    }

    /// Arms the CQ: the channel is signalled at the next completion queued after this call
    /// (with `solicited_only`: the next receive of a message with the Solicited Event flag,
    /// or the next completion with an error status). One notification per arming.
    ///
    /// As with verbs, poll the CQ once more after arming: a completion that arrived before
    /// the arming does not signal.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let _inside = self.shared.device.enter(Entry::ReqNotify)?;
        if !self.shared.markers_intact() {
            return Err(self.shared.markers_damaged("CompletionQueue::req_notify"));
        }
        if self.shared.channel.is_none() {
            return Err(Error::InvalidArgument(
                "req_notify needs a CQ created with a completion channel",
            ));
        }
        let mut st = lock(&self.shared.state);
        // An unsolicited arming wins over a pending solicited-only one.
        st.armed = Some(match st.armed {
            Some(prev) => prev && solicited_only,
            None => solicited_only,
        });
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct ChannelShared {
    fd: sys::EventFd,
    /// CQs that fired and were not yet returned by `get_cq_event`. The eventfd is readable
    /// exactly while this is not empty (both change under this lock).
    fired: Mutex<VecDeque<Weak<CqShared>>>,
}

impl ChannelShared {
    fn notify(&self, cq: &Arc<CqShared>) {
        let mut fired = lock(&self.fired);
        fired.push_back(Arc::downgrade(cq));
        if let Err(e) = self.fd.signal() {
            tracing::error!(error = %e, "completion channel: eventfd write failed");
        }
    }

    fn take(&self) -> Option<Arc<CqShared>> {
        let mut fired = lock(&self.fired);
        if fired.is_empty() {
            // The eventfd is not readable: no read to make (every look of a stream that
            // found nothing paid one `read` returning EAGAIN before 2026-12-02).
            return None;
        }
        let mut out = None;
        while let Some(w) = fired.pop_front() {
            if let Some(cq) = w.upgrade() {
                out = Some(cq);
                break;
            }
        }
        if fired.is_empty() {
            if let Err(e) = self.fd.drain() {
                tracing::error!(error = %e, "completion channel: eventfd read failed");
            }
        }
        out
    }
}

/// A completion channel: a file descriptor that becomes readable when an armed CQ attached
/// to it gets a completion. Put it in your own `poll`/`epoll` set, or wait with
/// [`CompletionChannel::get_cq_event`] (with the `tokio` feature also
/// `get_cq_event_async`, `AsyncCompletionChannel` and, for a CQ with a channel of its own,
/// `AsyncCq`).
#[derive(Debug, Clone)]
pub struct CompletionChannel {
    shared: Arc<ChannelShared>,
}

impl CompletionChannel {
    pub(crate) fn new() -> Result<Self> {
        let fd = sys::EventFd::new().map_err(|e| Error::io("eventfd", e))?;
        Ok(Self {
            shared: Arc::new(ChannelShared {
                fd,
                fired: Mutex::new(VecDeque::new()),
            }),
        })
    }

    /// Waits until an armed CQ of this channel fires and returns it (`None`: no time limit).
    /// The CQ is disarmed: call [`CompletionQueue::req_notify`] again for the next event.
    ///
    /// [`Error::WouldDeadlock`] on a thread where waiting would deadlock (a device's
    /// progress thread, which makes the completions; a callback inside a Softwarp call),
    /// unless `timeout` is zero.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<CompletionQueue> {
        crate::availability::context::check_wait("CompletionChannel::get_cq_event", timeout)?;
        let deadline = Deadline::from_timeout(timeout);
        loop {
            if let Some(cq) = self.shared.take() {
                return Ok(CompletionQueue::from_shared(cq));
            }
            let left = deadline.remaining();
            if left.is_some_and(|l| l.is_zero()) {
                return Err(Error::Timeout(timeout.unwrap_or_default()));
            }
            sys::poll_readable(self.shared.fd.as_fd(), left)
                .map_err(|e| Error::io("poll on completion channel", e))?;
        }
    }

    /// The CQ that fired, if one did; never blocks.
    pub fn try_get_cq_event(&self) -> Option<CompletionQueue> {
        self.shared.take().map(CompletionQueue::from_shared)
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.fd.as_fd()
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// `read` system calls this thread made so far (`/proc/thread-self/io`'s `syscr`).
    fn reads_of_this_thread() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        io.lines()
            .find_map(|l| l.strip_prefix("syscr: "))
            .and_then(|v| v.trim().parse().ok())
            .expect("syscr in /proc/thread-self/io")
    }

    /// A look at a channel with nothing fired makes no system call: a stream looks at its
    /// channel at every call (and the preload library's `epoll_wait` at every stream of the
    /// set), and each look paid a `read` of the eventfd that returned EAGAIN.
    #[test]
    fn a_look_at_a_quiet_channel_reads_nothing() {
        let ch = CompletionChannel::new().unwrap();
        let before = reads_of_this_thread();
        for _ in 0..1000 {
            assert!(ch.try_get_cq_event().is_none());
        }
        let reads = reads_of_this_thread() - before;
        assert!(
            reads < 10,
            "{reads} reads for 1000 looks at a quiet channel"
        );
        // An event is still taken, and the eventfd stops being readable with it.
        let dev = crate::Device::builder().open().unwrap();
        let cq = dev.create_cq(4, Some(&ch)).unwrap();
        ch.shared.notify(&cq.shared);
        assert!(sys::poll_readable(ch.shared.fd.as_fd(), Some(Duration::ZERO)).unwrap());
        assert!(ch.try_get_cq_event().is_some());
        assert!(!sys::poll_readable(ch.shared.fd.as_fd(), Some(Duration::ZERO)).unwrap());
        assert!(ch.try_get_cq_event().is_none());
    }
}
