//! The Softwarp side of `softwarp bench`: one endpoint (device, PD, CQ, QP, a source and a
//! sink region) per side, and the loops of the six shapes, written once for both roles.
//!
//! Bandwidth shapes keep `depth` operations outstanding (posted in lists of `post_list`),
//! signalling every `depth / 4`-th one. The receiving ("passive") side of `send_bw` keeps a
//! window of receives posted and returns credits to the sender with zero-length Sends that
//! carry the Solicited Event flag, one per quarter window (iWARP has no receiver-not-ready
//! retry: a Send without a posted receive kills the connection). Write and Read end with a
//! zero-length Send (a marker) that tells the passive side the active one is done; the
//! client's clock stops when the server says it saw everything. Latency shapes are
//! ping-pongs (Send, and Write with the receiver polling the last byte of its buffer, as
//! perftest does) or back-to-back Reads.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Result};
use softwarp::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, Device, MemoryRegion, Payload,
    QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, SgList, Stag, WcOpcode, WcStatus,
    WorkCompletion, EMPTY_COMPLETION, MAX_INLINE,
};

use super::ctrl::{Msg, CTRL_TIMEOUT};
use super::spec::{Kind, Mode, Op, Spec};

/// Receives kept posted for control Sends (credits, markers, latency pings).
const CTRL_RECVS: usize = 16;
/// Extra send queue room for credits and markers.
const SQ_SLACK: usize = 64;
/// How long one run may take before it is declared stuck.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// Marker and credit WRs are unsignalled and carry this id.
const CTRL_WR: u64 = u64::MAX;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;

/// Nanoseconds since `t` (saturating).
pub fn elapsed_ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Which end of the control channel this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that started the test (it times it).
    Client,
    /// The side that was asked to take part.
    Server,
}

/// What the peer's buffers are.
#[derive(Debug, Clone, Copy, Default)]
struct PeerMem {
    src_addr: u64,
    src_rkey: u32,
    dst_addr: u64,
    dst_rkey: u32,
}

/// One side of a Softwarp benchmark connection.
///
/// Fields drop in declaration order: the QP first, then the regions, the CQ, the channel
/// and last the device, so that nothing is still allocated when the device closes.
pub struct Ep {
    qp: QueuePair,
    src: MemoryRegion,
    dst: MemoryRegion,
    cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    _dev: Device,
    spec: Spec,
    peer: PeerMem,
    wcs: Vec<WorkCompletion>,
    wrs: Vec<SendWr<'static>>,
    inline: Vec<u8>,
    /// Copies of the one receive WR, reposted as a list (up to one per polled completion).
    recv_wrs: Vec<RecvWr>,
    /// Data WRs posted / completed so far (cumulative over runs).
    posted: u64,
    completed: u64,
    /// Total data Sends the peer allows (send_bw).
    credit_limit: u64,
    /// Data receives completed (cumulative) and since the last credit message.
    recv_data: u64,
    since_credit: usize,
    /// Markers received (cumulative).
    markers: u64,
    /// Last stamp used by write_lat.
    stamp: u8,
    /// Round-trip time of each iteration of the last latency run (client side), in ns.
    pub samples: Vec<u64>,
}

impl Ep {
    /// Creates the endpoint of `spec` on `dev` and posts its receives. The QPs of one side
    /// (`-q`) share that side's device (and so its progress thread), as perftest's QPs
    /// share one device context.
    pub fn new(spec: Spec, dev: &Device) -> Result<Self> {
        let dev = dev.clone();
        let pd = dev.alloc_pd()?;
        let channel = match spec.mode {
            Mode::Event => Some(dev.create_comp_channel()?),
            Mode::Busy | Mode::Spin => None,
        };
        let rq = spec.data_receives() + CTRL_RECVS;
        let sq = spec.depth + SQ_SLACK;
        let cq = dev.create_cq(rq + sq + 64, channel.as_ref())?;
        cq.set_busy_poll(spec.mode == Mode::Busy);
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.cap.max_send_wr = sq;
        attr.cap.max_recv_wr = rq;
        let rd = spec.depth.clamp(16, 128);
        attr.max_rd_atomic = rd;
        attr.max_dest_rd_atomic = rd;
        let qp = pd.create_qp(&attr)?;
        let len = spec.max_size.max(64);
        let src = pd.reg_mr(len, AccessFlags::REMOTE_READ)?;
        let dst = pd.reg_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        let recv_wr = RecvWr {
            wr_id: 0,
            sgl: SgList::single(dst.sge(0, u32::try_from(len)?)?),
        };
        let ep = Self {
            spec,
            _dev: dev,
            channel,
            cq,
            qp,
            src,
            dst,
            peer: PeerMem::default(),
            wcs: vec![EMPTY_COMPLETION; POLL_BATCH],
            wrs: Vec::with_capacity(spec.post_list),
            inline: vec![0u8; MAX_INLINE],
            recv_wrs: vec![recv_wr; POLL_BATCH.max(rq)],
            posted: 0,
            completed: 0,
            credit_limit: spec.data_receives() as u64,
            recv_data: 0,
            since_credit: 0,
            markers: 0,
            stamp: 0,
            samples: Vec::new(),
        };
        ep.post_recvs(rq)?;
        Ok(ep)
    }

    /// The connection options of `spec`.
    pub fn options(spec: &Spec) -> ConnectOptions {
        ConnectOptions::default()
            .crc(spec.crc)
            .max_fpdu_len((spec.fpdu > 0).then_some(spec.fpdu))
            .tx_alias_lead(spec.alias_lead)
            .timeout(CTRL_TIMEOUT)
    }

    /// The advert of this side's buffers.
    pub fn advert(&self) -> Msg {
        Msg::new("MR")
            .with("src", self.src.addr())
            .with("srck", self.src.rkey().0)
            .with("dst", self.dst.addr())
            .with("dstk", self.dst.rkey().0)
    }

    /// Connects to the benchmark server's listener.
    pub fn connect(&self, addr: std::net::SocketAddr) -> Result<()> {
        self.qp.connect(addr, &Self::options(&self.spec))?;
        Ok(())
    }

    /// Accepts the benchmark client's connection.
    pub fn accept(&self, listener: &softwarp::Listener) -> Result<()> {
        listener.accept_timeout(&self.qp, &Self::options(&self.spec), CTRL_TIMEOUT)?;
        Ok(())
    }

    /// Takes the peer's advert.
    pub fn set_peer(&mut self, m: &Msg) -> Result<()> {
        self.peer = PeerMem {
            src_addr: m.num("src")?,
            src_rkey: m.num("srck")?,
            dst_addr: m.num("dst")?,
            dst_rkey: m.num("dstk")?,
        };
        Ok(())
    }

    /// Gets ready for a run of `size` (nothing may be in flight).
    pub fn prepare(&mut self, size: usize) -> Result<()> {
        ensure!(
            size >= 1 && size <= self.spec.max_size,
            "size {size} outside 1..={}",
            self.spec.max_size
        );
        if self.spec.shape.kind == Kind::Lat && self.spec.shape.op == Op::Write {
            // write_lat polls the last byte of the buffer: start from zeros.
            self.dst.fill(0, size, 0)?;
        }
        Ok(())
    }

    /// Data work requests this side has completed so far (cumulative over runs): the
    /// operations the active side of a bandwidth run moved.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Runs one measurement of `iters` operations of `size` bytes in `role`.
    pub fn run(&mut self, role: Role, size: usize, iters: u64) -> Result<()> {
        let deadline = Instant::now() + RUN_TIMEOUT;
        let client = role == Role::Client;
        match (self.spec.shape.kind, self.spec.shape.op) {
            (Kind::Bw, _) => {
                let active = client || self.spec.bidir;
                let passive = !client || self.spec.bidir;
                self.bw(size, iters, active, passive, deadline)
            }
            (Kind::Lat, Op::Write) => self.write_lat(size, iters, client, deadline),
            (Kind::Lat, Op::Send) => self.send_lat(size, iters, client, deadline),
            (Kind::Lat, Op::Read) => {
                if client {
                    self.read_lat(size, iters, deadline)
                } else {
                    self.wait_markers(self.markers + 1, deadline)
                }
            }
        }
    }

    // ----- completions -----

    /// Fills `self.wcs`; with `block`, waits (per mode) until at least one arrived.
    fn poll(&mut self, block: bool, deadline: Instant) -> Result<usize> {
        let mut spins = 0u32;
        loop {
            let n = self.cq.poll(&mut self.wcs)?;
            if n > 0 || !block {
                return Ok(n);
            }
            match (&self.channel, self.spec.mode) {
                (Some(ch), Mode::Event) => {
                    self.cq.req_notify(false)?;
                    let n = self.cq.poll(&mut self.wcs)?;
                    if n > 0 {
                        return Ok(n);
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    ensure!(!left.is_zero(), "no completion within {RUN_TIMEOUT:?}");
                    match ch.get_cq_event(Some(left)) {
                        Ok(_) | Err(softwarp::Error::Timeout(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                _ => {
                    super::spin::wait_step(&mut spins, deadline, || {
                        format!("no completion within {RUN_TIMEOUT:?}")
                    })?;
                }
            }
        }
    }

    /// Posts `n` receives as one list.
    fn post_recvs(&self, n: usize) -> Result<()> {
        let wrs = self.recv_wrs.get(..n).unwrap_or(&self.recv_wrs);
        self.qp
            .post_recv_list(wrs)
            .map_err(|(i, e)| anyhow!("post_recv_list failed at {i}: {e}"))
    }

    /// Handles the completions in `self.wcs[..n]`. The receives they consumed are posted
    /// again first, as one list (before any credit goes out for them).
    fn handle(&mut self, n: usize) -> Result<()> {
        let recvs = self.wcs[..n]
            .iter()
            .filter(|wc| matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm))
            .count();
        if recvs > 0 {
            self.post_recvs(recvs)?;
        }
        for i in 0..n {
            let wc = self.wcs[i];
            if wc.status != WcStatus::Success {
                bail!(
                    "work request {} ({:?}) completed with {:?}",
                    wc.wr_id,
                    wc.opcode,
                    wc.status
                );
            }
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => self.on_recv(&wc)?,
                _ => {
                    if wc.wr_id != CTRL_WR {
                        self.completed = self.completed.max(wc.wr_id + 1);
                    }
                }
            }
        }
        Ok(())
    }

    fn on_recv(&mut self, wc: &WorkCompletion) -> Result<()> {
        let send_bw = self.spec.shape.op == Op::Send && self.spec.shape.kind == Kind::Bw;
        if send_bw && wc.solicited && wc.byte_len == 0 {
            self.credit_limit += self.spec.credit_batch() as u64;
        } else if self.spec.shape.op == Op::Send {
            self.recv_data += 1;
            if send_bw {
                self.since_credit += 1;
                if self.since_credit >= self.spec.credit_batch() {
                    self.since_credit = 0;
                    self.post_ctrl_send(true)?;
                }
            }
        } else {
            self.markers += 1;
        }
        Ok(())
    }

    /// A zero-length Send: a credit (Solicited Event) or a marker.
    fn post_ctrl_send(&self, solicited: bool) -> Result<()> {
        self.qp.post_send(&SendWr {
            wr_id: CTRL_WR,
            op: SendOp::Send {
                solicited,
                invalidate: None,
            },
            payload: Payload::Inline(&[]),
            signaled: false,
            fence: false,
        })?;
        Ok(())
    }

    fn wait_markers(&mut self, want: u64, deadline: Instant) -> Result<()> {
        while self.markers < want {
            let n = self.poll(true, deadline)?;
            self.handle(n)?;
        }
        Ok(())
    }

    // ----- bandwidth -----

    fn data_wr(&self, size: usize, wr_id: u64, signaled: bool) -> Result<SendWr<'static>> {
        let len = u32::try_from(size)?;
        let (op, sge) = match self.spec.shape.op {
            Op::Write => (
                SendOp::Write {
                    remote_addr: self.peer.dst_addr,
                    rkey: Stag(self.peer.dst_rkey),
                },
                self.src.sge(0, len)?,
            ),
            Op::Send => (
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                self.src.sge(0, len)?,
            ),
            Op::Read => (
                SendOp::Read {
                    remote_addr: self.peer.src_addr,
                    rkey: Stag(self.peer.src_rkey),
                },
                self.dst.sge(0, len)?,
            ),
        };
        Ok(SendWr {
            wr_id,
            op,
            payload: Payload::Sgl(SgList::single(sge)),
            signaled,
            fence: false,
        })
    }

    fn bw(
        &mut self,
        size: usize,
        iters: u64,
        active: bool,
        passive: bool,
        deadline: Instant,
    ) -> Result<()> {
        let op = self.spec.shape.op;
        let depth = self.spec.depth as u64;
        let cq_mod = (depth / 4).clamp(1, 64);
        let target = self.posted + if active { iters } else { 0 };
        let recv_target = self.recv_data + if passive && op == Op::Send { iters } else { 0 };
        let marker_target = self.markers + u64::from(passive && op != Op::Send);
        let mut marker_sent = !active || op == Op::Send;
        // Built once and reposted with a new id, as perftest prepares its WR list at set-up.
        let template = self.data_wr(size, 0, false)?;
        loop {
            let mut progressed = false;
            if self.posted < target {
                let outstanding = self.posted - self.completed;
                let mut room = depth.saturating_sub(outstanding).min(target - self.posted);
                if op == Op::Send {
                    room = room.min(self.credit_limit.saturating_sub(self.posted));
                }
                let want = (self.spec.post_list as u64).min(target - self.posted);
                if room >= want && want > 0 {
                    self.wrs.clear();
                    for _ in 0..want {
                        let id = self.posted;
                        let signaled = (id + 1).is_multiple_of(cq_mod) || id + 1 == target;
                        self.wrs.push(SendWr {
                            wr_id: id,
                            signaled,
                            ..template
                        });
                        self.posted += 1;
                    }
                    self.qp
                        .post_send_list(&self.wrs)
                        .map_err(|(i, e)| anyhow!("post_send_list failed at {i}: {e}"))?;
                    progressed = true;
                }
            }
            if !marker_sent
                && self.posted == target
                && (op == Op::Write || self.completed == target)
            {
                // The marker follows the data in the stream: for Writes it may be posted
                // at once; Reads end when their responses are in.
                self.post_ctrl_send(false)?;
                marker_sent = true;
                progressed = true;
            }
            let active_done = self.completed >= target && marker_sent;
            let passive_done = self.recv_data >= recv_target && self.markers >= marker_target;
            if active_done && passive_done {
                return Ok(());
            }
            let n = self.poll(!progressed, deadline)?;
            self.handle(n)?;
        }
    }

    // ----- latency -----

    fn next_stamp(&mut self) -> u8 {
        self.stamp = if self.stamp == 255 { 1 } else { self.stamp + 1 };
        self.stamp
    }

    fn write_lat(
        &mut self,
        size: usize,
        iters: u64,
        client: bool,
        deadline: Instant,
    ) -> Result<()> {
        ensure!(
            self.spec.mode != Mode::Event,
            "write_lat polls memory and has no event mode (as perftest's ib_write_lat)"
        );
        let busy = self.spec.mode == Mode::Busy;
        let mut byte = [0u8; 1];
        self.samples.clear();
        for i in 0..iters {
            let t = Instant::now();
            let stamp = self.next_stamp();
            if client {
                self.write_stamped(size, stamp, i)?;
            }
            let mut spins = 0u32;
            loop {
                if busy {
                    let n = self.poll(false, deadline)?;
                    self.handle(n)?;
                }
                self.dst.read_at(size - 1, &mut byte)?;
                if byte[0] == stamp {
                    break;
                }
                spins += 1;
                if spins.is_multiple_of(4096) {
                    if !busy {
                        let n = self.poll(false, deadline)?;
                        self.handle(n)?;
                    }
                    ensure!(Instant::now() < deadline, "write_lat: no Write arrived");
                }
                super::spin::pause(spins);
            }
            if !client {
                self.write_stamped(size, stamp, i)?;
            } else {
                self.samples.push(elapsed_ns(t));
            }
            if !busy {
                // Take the Writes' completions (one in 16 is signalled) as they come.
                let n = self.poll(false, deadline)?;
                self.handle(n)?;
            }
        }
        // Take the last completions so the CQ is empty for the next run.
        let n = self.poll(false, deadline)?;
        self.handle(n)
    }

    fn write_stamped(&mut self, size: usize, stamp: u8, i: u64) -> Result<()> {
        self.src.write_at(size - 1, &[stamp])?;
        self.post_data(size, i, Some(stamp))
    }

    fn send_lat(&mut self, size: usize, iters: u64, client: bool, deadline: Instant) -> Result<()> {
        self.samples.clear();
        for i in 0..iters {
            let t = Instant::now();
            if client {
                self.send_one(size, i)?;
            }
            let want = self.recv_data + 1;
            while self.recv_data < want {
                let n = self.poll(true, deadline)?;
                self.handle(n)?;
            }
            if !client {
                self.send_one(size, i)?;
            } else {
                self.samples.push(elapsed_ns(t));
            }
        }
        Ok(())
    }

    fn send_one(&mut self, size: usize, i: u64) -> Result<()> {
        self.post_data(size, i, None)
    }

    /// Posts data WR `i` of `size` bytes (one in 16 signalled), inline when it fits; `stamp`
    /// goes into the last inline byte, as `write_stamped` put it into the source region.
    fn post_data(&mut self, size: usize, i: u64, stamp: Option<u8>) -> Result<()> {
        let wr_id = self.posted;
        self.posted += 1;
        let signaled = i % 16 == 15;
        let wr = self.data_wr(size, wr_id, signaled)?;
        if size <= MAX_INLINE {
            self.inline.resize(size, 0);
            if let (Some(stamp), Some(last)) = (stamp, self.inline.last_mut()) {
                *last = stamp;
            }
            let wr_inline = SendWr {
                payload: Payload::Inline(&self.inline),
                ..wr
            };
            self.qp.post_send(&wr_inline)?;
        } else {
            self.qp.post_send(&wr)?;
        }
        Ok(())
    }

    fn read_lat(&mut self, size: usize, iters: u64, deadline: Instant) -> Result<()> {
        self.samples.clear();
        for _ in 0..iters {
            let t = Instant::now();
            let wr_id = self.posted;
            self.posted += 1;
            let wr = self.data_wr(size, wr_id, true)?;
            self.qp.post_send(&wr)?;
            while self.completed <= wr_id {
                let n = self.poll(true, deadline)?;
                self.handle(n)?;
            }
            self.samples.push(elapsed_ns(t));
        }
        self.post_ctrl_send(false)?;
        Ok(())
    }
}
