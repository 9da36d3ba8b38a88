//! `softwarp bench -R`: perftest's own rdma_cm exchange, so that one side can be
//! `ib_send_bw`, `ib_write_bw`, `ib_read_bw`, `ib_send_lat`, `ib_write_lat` or
//! `ib_read_lat -R` (perftest 4.5, version "6.06") over Linux siw, in either role.
//!
//! Two MPA connections to the server's one port: first the control QP, whose Sends carry
//! the exchange ([`wire`]), then the data QP. Every exchange step is "client sends, server
//! answers with the same message type":
//!
//! ```text
//! control QP connects
//! version (16 B), cycle buffer (4 B), cache line size (4 B), MTU (2 B), zero destination
//! data QP connects (IRD = ORD = out_reads for the Read shapes, 0 otherwise)
//! zero destination, then this side's destination: 3 times, or 4 in write_lat and read_lat
//!                                    (send_bw: its rkey/vaddr name the credit word)
//! per size (one, or with -a every power of two from 2 B to 8 MiB):
//!   send_bw, send_lat (and write_bw, read_bw with -b): destination (the receiver posted its
//!                     receives before it; send_bw's sender then zeroes its credit word)
//!   the measurement
//!   -b: (with -a, write_bw and read_bw: destination) both reports
//!   -a, send_bw: destination
//! write_bw, read_bw without -b: destination, report (size, iterations, peak MB/s, average
//!                    MB/s, Mmsg/s; 8 bytes each; with -a the last size's), destination
//! write_bw, read_bw with -b, send_bw, send_lat, read_lat: destination
//! write_lat: nothing
//! ```
//!
//! The measurement follows perftest: the client alone posts in the bandwidth shapes (the
//! server of write_bw and read_bw is idle; the server of send_bw receives and RDMA Writes
//! its count of received messages into the client's credit word every `rx_depth / 3`
//! receives, and the client keeps fewer than `rx_depth` Sends uncredited); send_lat is a
//! ping-pong that the client starts; in write_lat the server writes first and each side
//! polls the last byte of its buffer for the count of Writes it received; read_lat is the
//! client's back-to-back Reads. With `-b` (bandwidth shapes) both ends post, and send_bw's
//! credits flow both ways (perftest's `run_iter_bi`: the server sends after its first
//! receive). Completions are spun on; the device's progress thread moves the bytes.
//!
//! # Details: what the captures and perftest's sources showed
//!
//! Learned from the captures of siw↔siw perftest (`testdata/captures/siw-ib_{write,read,send}_bw.pcap`
//! and `siw-crc-*`; the `_lat` tools captured the same way in the guest), perftest's sources
//! (`perftest_communication.c`: `ctx_xchg_data_rdma`, `rdma_write_keys`/`rdma_read_keys`,
//! `exchange_versions`, `check_sys_data`, `check_mtu`, `xchg_bw_reports`, `ctx_close_connection`;
//! `perftest_resources.c`: `rdma_client_connect`/`rdma_server_connect`, `ctx_alloc_credit`,
//! `run_iter_bw`/`run_iter_bw_server`, `run_iter_lat_write`), and the guest's perftest 4.5+0.17
//! (version string "6.06"), which is what counts.
//!
//! - **Two MPA connections to the server's one port** (18515 by default): first the control QP,
//!   then the data QP. Both are RC over rdma_cm, MPA rev 2; the control connection offers IRD/ORD
//!   0/0; the data connection 0/0 for Send and Write, `out_reads`/`out_reads` for Read (siw: 128,
//!   its device maximum; private data `00800080`). perftest's server destroys its listening id after
//!   the control connection and listens again for the data QP, so the client may find the port
//!   closed for a moment: we retry the data connect (20 times, 100 ms apart; one retry is typical).
//! - **Every message is one Send on the control QP**, payload at most `sizeof(struct
//!   pingpong_dest)` = 56 bytes (perftest's only control receive buffer). Each step is symmetric:
//!   the client sends first and waits for the server's message of the same type; the server
//!   receives first, then answers. The messages, in order:
//!
//!   | step | bytes | content |
//!   | --- | --- | --- |
//!   | version | 16 | ASCII, NUL-padded: `"6.06"` (`362e3036` + zeros). We refuse peers older than 5.33 (other formats) |
//!   | cycle buffer | 4 | big-endian `int`: the page size, 4096; both take the larger |
//!   | cache line | 4 | big-endian `int`: 64; both take the larger |
//!   | MTU | 2 | `sprintf("%d")` of the `ibv_mtu` enum, 2 bytes: `"3\0"` (1024; siw) |
//!   | destination ×1 | 56 | all zeros (the server listens again for the data QP meanwhile) |
//!   | *data QP connects* | | |
//!   | destination ×1 | 56 | all zeros |
//!   | destination ×3 (write_bw, read_bw) or ×4 (send_bw, every `_lat`) | 56 | `struct pingpong_dest`, big-endian fields: LID (0), out_reads, QPN, PSN (random 24 bits), rkey, 4 bytes of C padding (perftest sends stack garbage there: ignored), vaddr (u64), GID (16 raw bytes; siw's is MAC-based `5254:0077:0002::`), SRQN, GID index |
//!   | *the measurement* | | |
//!   | write_bw, read_bw: destination, then the report, then destination | 56, 5×8, 56 | report (`xchg_bw_reports`): size and iterations (u64 BE), peak MB/s, average MB/s, Mmsg/s (doubles, byte-swapped bit patterns, `hton_double`); perftest's server sends uninitialized memory and prints the client's |
//!   | send_bw, send_lat, read_lat: destination | 56 | the closing handshake (`ctx_close_connection`) |
//!   | write_lat | | nothing: both sides just tear down |
//!
//!   The destination's rkey/vaddr name the buffer the peer may access: the data buffer
//!   (`buf + BUFF_SIZE`), or for send_bw the **credit word**. perftest writes into its peer's
//!   buffer at `vaddr`, cycling through `cycle_buffer` bytes when the message is at most half of it;
//!   our window is `max(size, cycle)` rounded to cache lines, and we always use the start.
//! - **The measurement, per shape.** write_bw and read_bw: only the client posts (window `-t`, Reads
//!   also at most `out_reads`); the server idles until the closing handshake and prints the
//!   client's report. send_bw over iWARP uses **credits** (`send_rcredit`, set for
//!   `IBV_TRANSPORT_IWARP`): the receiver RDMA Writes its count of received messages, a
//!   little-endian u32 (host order; `02000000`, `04000000` in the capture), into the sender's credit
//!   word every `rx_depth / 3` receives, and the sender posts only while `scnt + 1 - credit <
//!   rx_depth` (iWARP has no receiver-not-ready retry: a Send without a posted receive kills the
//!   connection). `rx_depth` is perftest's `-r` (512) clamped to `-n`; the sender does not learn the
//!   receiver's, so both sides must use the same flags, as with perftest itself (`--rx-depth`).
//!   send_lat: the client sends, the server answers, `-n` times. write_lat: **the server writes
//!   first**; each side spins on the last byte of its buffer until it equals the count of Writes
//!   received (mod 256), then writes its own count there on the peer (the last byte of a `-s`-byte
//!   Write). read_lat: the client's Reads, one at a time; the server idles.
//! - **`-a`: every size on one pair of connections** (learned from siw↔siw captures of all six
//!   tools with `-a -n 5` in the guest, and perftest's `send_bw.c`, `send_lat.c`, `write_bw.c`,
//!   `read_lat.c`, `write_lat.c` main loops). perftest's `-a` runs the powers of two from 2 B to
//!   8 MiB (`for (i = 1; i < 24; ++i) size = 1 << i`), 23 sizes, `-n` iterations at **every**
//!   size (the lat tools too: `ib_send_lat -a -n 5` prints 5 at each size; nothing scales them).
//!   Both ends size their buffers for the largest size (`user_param->size = MAX_SIZE` before
//!   allocation), so the buffer a destination names is at least 8 MiB: our `-a` registers
//!   `max(largest size, cycle buffer)` per half. Nothing in the preamble says `-a`: both ends must
//!   be given it. Between sizes, per shape:
//!
//!   | shape | after the data connection | each size | at the end |
//!   | --- | --- | --- | --- |
//!   | send_bw | zero + 3 destinations | receiver posts `rx_depth` receives (`ctx_set_recv_wqes`), handshake, the sender zeroes its credit word, the data, handshake | closing handshake |
//!   | send_lat | zero + 3 | both post receives, handshake, the ping-pong | closing handshake |
//!   | write_bw, read_bw | zero + 3 | the data (client only), nothing on the control QP | handshake, **one** report (the last size's: 8 MiB), handshake |
//!   | write_lat | zero + 4 | the data, nothing else: the counters restart at 1 and the polled byte moves to `size - 1` (each size's byte lies beyond every earlier size's Writes, so no reset is needed) | nothing |
//!   | read_lat | zero + 4 | the client's Reads | closing handshake |
//!
//!   So a plain run is the one-size case of the same scheme: the handshake right before the
//!   measurement of the Send shapes is the per-size one (the plain run's 4th destination). The
//!   send_bw receiver writes credits counted from 0 each size (`rcnt` is per `run_iter_bw_server`
//!   call) and reposts exactly `iters - rx_depth` receives, so no receive outlives its size; the
//!   sender's `credit_buf` reset comes after the handshake, before the first Send. perftest's
//!   server of write_bw/read_bw prints one line (the 8 MiB report); its read_lat server prints none.
//!   Our rows: one per size (`bench -R ... -a`), one for the passive write_bw/read_bw server, none
//!   for the read_lat server. Our `-a -s N` caps the sizes at N (a power of two) for runs between
//!   two softwarp ends (tests); against perftest the cap must stay 8 MiB.
//! - **`-b`: both directions at once** (bandwidth tools; siw↔siw captures of `ib_{send,write,read}_bw
//!   -b -s 4096 -n 20` and `-b -a -n 5`; perftest's `run_iter_bi`). Both ends post: write_bw and
//!   read_bw run the one-sided loop on both ends (`run_iter_bw`), send_bw runs `run_iter_bi`: each
//!   end sends `iters` and receives `iters`, reposting receives and RDMA Writing its count of
//!   receives into the peer's credit word (iWARP credits, now both ways), and the **server sends
//!   only after its first receive** (`before_first_rx`). Control messages:
//!
//!   | shape | after the data connection | each size | at the end |
//!   | --- | --- | --- | --- |
//!   | write_bw, read_bw | zero + 3 | handshake, the data, (with `-a` only: one more handshake, perftest's "version >= 4.6" sync), **both** reports (5 fields each way, each side's own) | closing handshake |
//!   | send_bw | zero + 3 | (receives posted) handshake, credit word zeroed, the data, both reports, (with `-a` only: the handshake after the size) | closing handshake |
//!
//!   Without `-a` this is one size of the same scheme. perftest prints the sum of both sides'
//!   average MB/s; our row is `bidirectional` and carries that sum (the time that moves
//!   `2 × size × iters` bytes at it). perftest's `-n` must be at least 5 (its parser refuses less).
//!   The credit cadence differs slightly (perftest writes when `(rcnt % rx_depth) % (rx_depth/3)
//!   == 0`, we every `rx_depth/3` receives); each sender only needs fewer than `rx_depth`
//!   uncredited Sends, so both keep going. The latency tools have no `-b`; we refuse it there.
//! - **Teardown.** perftest destroys its QPs right after its last control message completes. If we
//!   closed first, the peer could see its last Send flushed (siw: "Bad wc status 2") even though
//!   we had received it. So our server waits (up to 10 s) for the client's disconnect, our client
//!   (up to 1 s) for the server's, then each disconnects gracefully.
//! - **Where it lives.** `softwarp-bench/src/perftest/wire.rs` is the codec (no I/O; typed `ExchangeError` for a
//!   wrong length, a version that is not one or too old, implausible sizes, a bad MTU digit;
//!   known-answer tests from the capture bytes); `perftest/mod.rs` runs a session in either
//!   role (`perftest/measure.rs`: the data phase of each shape) on the `softwarp` crate's
//!   connection manager (`CmEventChannel`, `CmListener`,
//!   `ConnectOptions::linux_siw()` + `--crc`). By default completions are spun on and the device's
//!   progress thread moves the bytes; with `--mode busy` the CQs are busy-polled, as perftest's
//!   under `softwarp exec --busy-poll`: the polling thread moves its QPs' bytes, and what this
//!   side waits for without polling a CQ (the credit word, write_lat's byte, the passive end of
//!   write_bw and read_bw) is moved by the progress thread once it takes the QP over (DESIGN.md,
//!   "Busy-poll CQs"). There is no raw TCP baseline in a `-R` run: the peer speaks
//!   perftest's protocol, not ours.
//!

mod measure;
pub mod wire;

use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use softwarp::{
    AccessFlags, CmEvent, CmEventChannel, CmId, CompletionQueue, ConnectOptions, Device,
    ListenOptions, MemoryRegion, Payload, ProtectionDomain, QpInitAttr, QueuePair, RecvWr, SendOp,
    SendWr, SgList, WcOpcode, WcStatus, WorkCompletion, EMPTY_COMPLETION,
};

use self::wire::{BwReport, Dest};
use super::session::Timed;
use super::spec::{Kind, Op, Shape};

/// Our cycle buffer (perftest: the page size) and cache line size.
const CYCLE_BUFFER: u32 = 4096;
const CACHE_LINE: u32 = 64;
/// The MTU we announce: `IBV_MTU_1024`, as siw reports.
const MTU_1024: u8 = 3;
/// Bound of every wait for one step of the exchange or one completion.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Control receives kept posted.
const CTRL_RECVS: usize = 2;
/// Bytes per control receive (perftest's messages are at most 56).
const CTRL_SLOT: usize = 64;
/// The initiator's first-FPDU hold-off (siw's Reply race; see `Side::options`).
const FIRST_FPDU_DELAY: Duration = Duration::from_millis(100);
/// Credit Writes of send_bw -b kept outstanding at most (beside the Sends).
const CREDIT_WRITES_MAX: usize = 16;
/// Attempts at the data connection (perftest's server may listen again a little late).
const DATA_CONNECT_TRIES: u32 = 20;

/// What one perftest session runs: perftest's own flags.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// The test (`ib_<shape>`).
    pub shape: Shape,
    /// `-s`: message size; with `all`, the largest size (perftest: 8 MiB).
    pub size: usize,
    /// `-a`: every power of two from 2 bytes to `size`, one after the other on the same
    /// connections (perftest's `-a`, whose largest size is 8 MiB).
    pub all: bool,
    /// `-b`: both directions at once (bandwidth shapes; each side sends `iters` and the
    /// two exchange their reports after each size).
    pub bidir: bool,
    /// `-n`: iterations.
    pub iters: u64,
    /// `-t`: outstanding operations of the bandwidth shapes.
    pub tx_depth: usize,
    /// `-r`: receive queue depth of `ib_send_bw`'s receiver (the credit window).
    pub rx_depth: usize,
    /// `-o`: outstanding RDMA Reads (IRD/ORD of the data connection).
    pub out_reads: usize,
    /// Ask for CRC32c.
    pub crc: bool,
    /// Busy-poll the completion queues (`--mode busy`): the thread polling a CQ moves its
    /// QPs' bytes, and a QP whose CQ this side does not poll (the credit word, write_lat's
    /// byte, the passive end of write_bw and read_bw) is taken over by the progress thread,
    /// as for perftest under `softwarp exec --busy-poll`. Otherwise the loops spin and the
    /// progress thread moves the bytes.
    pub busy: bool,
    /// How long the server waits for a client.
    pub accept_timeout: Duration,
}

impl Params {
    /// The sizes measured, in order: `size`, or with `all` the powers of two from 2 to
    /// `size`.
    pub fn sizes(&self) -> Vec<usize> {
        if self.all {
            (1..usize::BITS)
                .map(|k| 1usize << k)
                .take_while(|&s| s <= self.size)
                .collect()
        } else {
            vec![self.size]
        }
    }

    /// Iterations at `size`: `-n` at every size (perftest's `-a` too).
    pub fn iters_at(&self, _size: usize) -> u64 {
        self.iters
    }

    /// The credit window perftest's `ib_send_bw` uses (`rx_depth`, at most the iterations).
    fn rx_window(&self) -> u64 {
        (self.rx_depth as u64).min(self.iters).max(1)
    }
}

/// The figures of one message size.
#[derive(Debug, Clone)]
pub struct SizeRow {
    /// Message size.
    pub size: usize,
    /// Iterations at this size.
    pub iters: u64,
    /// The measurement.
    pub timed: Timed,
}

/// What a session measured and learned.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// This side's measurements, one per size (or, for the passive server of write_bw and
    /// read_bw, one from the client's report: perftest exchanges only the last size's);
    /// empty when this side has no figures (read_lat's server).
    pub rows: Vec<SizeRow>,
    /// The peer's perftest version.
    pub peer_version: String,
    /// The client's report (write_bw and read_bw).
    pub report: Option<BwReport>,
    /// The negotiated data connection: CRC in use, MPA revision, IRD/ORD.
    pub data_conn: String,
}

/// One side's verbs objects. Fields drop in declaration order: QPs before regions, regions
/// before CQs, the device last.
struct Side {
    ctrl_qp: QueuePair,
    data_qp: QueuePair,
    ctrl_recv: MemoryRegion,
    data: Option<MemoryRegion>,
    credit: MemoryRegion,
    ctrl_scq: CompletionQueue,
    ctrl_rcq: CompletionQueue,
    data_scq: CompletionQueue,
    data_rcq: CompletionQueue,
    pd: ProtectionDomain,
    ids: Vec<CmId>,
    ch: CmEventChannel,
    _dev: Device,
    client: bool,
    p: Params,
    wcs: Vec<WorkCompletion>,
    /// Bytes of one half of the data region (the peer's window, then our source).
    half: usize,
    /// The message size being measured (one of `p.sizes()`).
    cur: usize,
    /// When the data QP may send its first FPDU (the initiator's first-FPDU hold-off).
    data_ready: Instant,
}

fn check(wc: &WorkCompletion, what: &str) -> Result<()> {
    ensure!(
        wc.status == WcStatus::Success,
        "{what}: work request {} ({:?}) completed with {:?}",
        wc.wr_id,
        wc.opcode,
        wc.status
    );
    Ok(())
}

impl Side {
    fn new(p: Params, client: bool) -> Result<Self> {
        let dev = Device::open_default()?;
        let pd = dev.alloc_pd()?;
        let attr = dev.query();
        let reads = p
            .out_reads
            .clamp(1, attr.max_qp_rd_atom.min(attr.max_qp_init_rd_atom));
        let rq = match p.shape.op {
            Op::Send => p.rx_window() as usize + 8,
            _ => 8,
        };
        // send_bw -b: the credit Writes share the send queue with the Sends.
        let sq = p.tx_depth.max(1) + 16 + if p.bidir { CREDIT_WRITES_MAX } else { 0 };
        let ctrl_scq = dev.create_cq(64, None)?;
        let ctrl_rcq = dev.create_cq(64, None)?;
        let data_scq = dev.create_cq(sq + 64, None)?;
        let data_rcq = dev.create_cq(rq + 64, None)?;
        for cq in [&ctrl_scq, &ctrl_rcq, &data_scq, &data_rcq] {
            cq.set_busy_poll(p.busy);
        }
        let mut cattr = QpInitAttr::new(&ctrl_scq, &ctrl_rcq);
        cattr.cap.max_send_wr = 8;
        cattr.cap.max_recv_wr = 8;
        let ctrl_qp = pd.create_qp(&cattr)?;
        let mut dattr = QpInitAttr::new(&data_scq, &data_rcq);
        dattr.cap.max_send_wr = sq;
        dattr.cap.max_recv_wr = rq;
        dattr.max_rd_atomic = reads;
        dattr.max_dest_rd_atomic = reads;
        let data_qp = pd.create_qp(&dattr)?;
        let ctrl_recv = pd.reg_mr(CTRL_SLOT * CTRL_RECVS, AccessFlags::LOCAL_WRITE)?;
        let credit = pd.reg_mr(8, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        for i in 0..CTRL_RECVS {
            ctrl_qp.post_recv(&RecvWr {
                wr_id: i as u64,
                sgl: SgList::single(ctrl_recv.sge(i * CTRL_SLOT, CTRL_SLOT as u32)?),
            })?;
        }
        let mut p = p;
        p.out_reads = reads;
        // The data region is registered once the cycle buffer is agreed (`Side::preamble`).
        let side = Self {
            ctrl_qp,
            data_qp,
            ctrl_recv,
            data: None,
            credit,
            ctrl_scq,
            ctrl_rcq,
            data_scq,
            data_rcq,
            pd,
            ids: Vec::new(),
            ch: CmEventChannel::new()?,
            _dev: dev,
            client,
            p,
            wcs: vec![EMPTY_COMPLETION; 64],
            half: 0,
            cur: p.size,
            data_ready: Instant::now(),
        };
        Ok(side)
    }

    fn options(&self, reads: usize) -> ConnectOptions {
        // perftest speaks first from either end (the server of write_lat writes first), and
        // siw as responder needs the first-FPDU hold-off (see ConnectOptions). 20 ms (the
        // default) left perftest's server over siw with its first control Send stuck in
        // its send queue once in about 20 control connections under TCG (our version
        // arrived, its answer never left): a longer hold-off, paid once per connection.
        ConnectOptions::linux_siw()
            .first_fpdu_delay(FIRST_FPDU_DELAY)
            .crc(self.p.crc)
            .timeout(Duration::from_secs(10))
            .ird(reads)
            .ord(reads)
    }

    fn data_reads(&self) -> usize {
        match self.p.shape.op {
            Op::Read => self.p.out_reads,
            _ => 0,
        }
    }

    fn data(&self) -> Result<&MemoryRegion> {
        self.data
            .as_ref()
            .ok_or_else(|| anyhow!("the data region is not registered yet"))
    }

    // ----- control QP -----

    fn wait_wc(&mut self, send: bool, what: &str) -> Result<WorkCompletion> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        let mut spins = 0u32;
        loop {
            let cq = if send { &self.ctrl_scq } else { &self.ctrl_rcq };
            let n = cq.poll(&mut self.wcs[..1])?;
            if n == 1 {
                let wc = self.wcs[0];
                check(&wc, what)?;
                return Ok(wc);
            }
            // Spin as perftest does (its ibv_poll_cq loops never sleep); a long wait, such as
            // the passive end's for the client's report, is left to the CQ's idle sleep
            // (`CompletionQueue::set_idle_sleep`), as perftest's over the C ABI is.
            spins += 1;
            if spins.is_multiple_of(1024) {
                ensure!(
                    Instant::now() < deadline,
                    "perftest exchange: no {what} within {STEP_TIMEOUT:?}"
                );
            }
            super::spin::pause(spins);
        }
    }

    fn send_msg(&mut self, msg: &[u8]) -> Result<()> {
        ensure!(msg.len() <= wire::DEST_LEN, "control message too long");
        self.ctrl_qp.post_send(&SendWr {
            wr_id: 0,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Inline(msg),
            signaled: true,
            fence: false,
        })?;
        let wc = self.wait_wc(true, "control Send completion")?;
        ensure!(
            wc.opcode == WcOpcode::Send,
            "control QP: unexpected {:?}",
            wc.opcode
        );
        Ok(())
    }

    fn recv_msg(&mut self) -> Result<Vec<u8>> {
        let wc = self.wait_wc(false, "control message from the peer")?;
        let slot = usize::try_from(wc.wr_id)?;
        ensure!(slot < CTRL_RECVS, "control receive with unknown id {slot}");
        let len = (wc.byte_len as usize).min(CTRL_SLOT);
        let mut b = vec![0u8; len];
        self.ctrl_recv.read_at(slot * CTRL_SLOT, &mut b)?;
        self.ctrl_qp.post_recv(&RecvWr {
            wr_id: wc.wr_id,
            sgl: SgList::single(self.ctrl_recv.sge(slot * CTRL_SLOT, CTRL_SLOT as u32)?),
        })?;
        Ok(b)
    }

    /// One step: the client sends first, the server answers.
    fn xchg(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        if self.client {
            self.send_msg(mine)?;
            self.recv_msg()
        } else {
            let theirs = self.recv_msg()?;
            self.send_msg(mine)?;
            Ok(theirs)
        }
    }

    fn handshake(&mut self, mine: &Dest) -> Result<Dest> {
        let b = self.xchg(&mine.encode())?;
        Ok(Dest::decode(&b)?)
    }

    /// Version, system data and MTU; then registers the data region for the agreed cycle
    /// buffer. Returns the peer's version.
    fn preamble(&mut self) -> Result<String> {
        let v = wire::decode_version(&self.xchg(&wire::encode_version(wire::OUR_VERSION))?)?;
        let cycle = wire::decode_size(
            "cycle buffer",
            &self.xchg(&wire::encode_size(CYCLE_BUFFER))?,
            1 << 30,
        )?;
        let line = wire::decode_size(
            "cache line size",
            &self.xchg(&wire::encode_size(CACHE_LINE))?,
            1 << 16,
        )?;
        let _mtu = wire::decode_mtu(&self.xchg(&wire::encode_mtu(MTU_1024))?)?;
        // perftest cycles its remote address through `cycle` bytes (messages up to half of
        // it) or always uses the start: the peer's window is max(size, cycle) rounded up to
        // cache lines, and our source follows it.
        let cycle = cycle.max(CYCLE_BUFFER) as usize;
        let line = line.max(CACHE_LINE) as usize;
        self.half = self.p.size.max(cycle).div_ceil(line) * line;
        self.data = Some(self.pd.reg_mr(
            2 * self.half,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?);
        Ok(v.text)
    }

    /// This side's destination: the data QP, and the buffer the peer may use (the credit
    /// word for send_bw).
    fn my_dest(&self) -> Result<Dest> {
        let data = self.data()?;
        let (rkey, vaddr) = match (self.p.shape.op, self.p.shape.kind) {
            (Op::Send, Kind::Bw) => (self.credit.rkey().0, self.credit.addr()),
            _ => (data.rkey().0, data.addr()),
        };
        // A PSN means nothing to iWARP; perftest draws a random 24-bit one.
        let psn = (std::process::id() ^ self.data_qp.qp_num().rotate_left(12)) & 0x00ff_ffff;
        Ok(Dest {
            lid: 0,
            out_reads: match self.p.shape.op {
                Op::Read => u32::try_from(self.p.out_reads)?,
                _ => 1,
            },
            qpn: self.data_qp.qp_num(),
            psn,
            rkey,
            vaddr,
            gid: [0; 16],
            srqn: 0,
            gid_index: 0,
        })
    }

    /// Receives of the data QP: the whole credit window for send_bw, a few for send_lat.
    /// Each takes the largest size (with `-a` they outlive a size).
    fn post_data_recvs(&mut self, n: u64) -> Result<()> {
        let sge = self.data()?.sge(0, u32::try_from(self.p.size)?)?;
        let wr = RecvWr {
            wr_id: 0,
            sgl: SgList::single(sge),
        };
        for _ in 0..n {
            self.data_qp.post_recv(&wr)?;
        }
        Ok(())
    }

    /// Whether perftest handshakes right before each measurement: in the Send shapes
    /// always (in a plain run it is the last handshake before the measurement, with `-a`
    /// one per size, after the receiver posted its receives), in write_bw and read_bw only
    /// with `-b`.
    fn sync_before_run(&self) -> bool {
        self.p.shape.op == Op::Send || (self.p.bidir && self.p.shape.kind == Kind::Bw)
    }

    /// Pre-measurement handshakes after the data connection (the zero destination, then
    /// ours: 3 times, or 4 in write_lat and read_lat, which have no handshake right before
    /// the measurement); returns the peer's destination.
    fn handshakes_before(&mut self) -> Result<Dest> {
        self.handshake(&Dest::default())?;
        let mine = self.my_dest()?;
        let count = match (self.p.shape.op, self.p.shape.kind) {
            (Op::Send, _) | (_, Kind::Bw) => 3,
            (Op::Write | Op::Read, Kind::Lat) => 4,
        };
        let mut peer = Dest::default();
        for i in 0..count {
            let d = self.handshake(&mine)?;
            if i == 0 {
                peer = d;
            } else if (d.rkey, d.vaddr) != (peer.rkey, peer.vaddr) {
                bail!(
                    "perftest peer changed its buffer between handshakes ({:#x}@{:#x}, then {:#x}@{:#x})",
                    peer.rkey,
                    peer.vaddr,
                    d.rkey,
                    d.vaddr
                );
            }
        }
        Ok(peer)
    }

    /// perftest's `xchg_bw_reports`: the five fields one by one, each a client-first step.
    fn xchg_report(&mut self, mine: &BwReport) -> Result<BwReport> {
        let fields = mine.encode();
        let mut got: [Vec<u8>; 5] = Default::default();
        for (slot, f) in got.iter_mut().zip(fields.iter()) {
            *slot = self.xchg(f)?;
        }
        Ok(BwReport::decode(&got)?)
    }

    /// After the measurement: the closing handshakes (and the report of write_bw/read_bw
    /// without `-b`: the client's, which the server prints).
    fn handshakes_after(&mut self, mine: Option<BwReport>) -> Result<Option<BwReport>> {
        let dest = self.my_dest()?;
        let report = match (self.p.shape.op, self.p.shape.kind, self.p.bidir) {
            (Op::Write | Op::Read, Kind::Bw, false) => {
                self.handshake(&dest)?;
                let r = self.xchg_report(&mine.unwrap_or_default())?;
                self.handshake(&dest)?;
                Some(r)
            }
            (Op::Write, Kind::Lat, _) => None,
            _ => {
                self.handshake(&dest)?;
                None
            }
        };
        Ok(report)
    }

    // ----- connections -----

    fn connect(&mut self, addr: SocketAddr) -> Result<(String, String)> {
        let opts = self.options(1);
        let (id, _) = self
            .ch
            .connect_blocking(&self.ctrl_qp, addr, &opts)
            .with_context(|| format!("control connection to {addr}"))?;
        self.ids.push(id);
        let version = self.preamble()?;
        self.handshake(&Dest::default())?;
        if self.p.shape.op == Op::Send {
            self.post_data_recvs(self.p.rx_window())?;
        }
        let reads = self.data_reads();
        let opts = self.options(reads);
        let mut tries = 0;
        let (id, info) = loop {
            tries += 1;
            match self.ch.connect_blocking(&self.data_qp, addr, &opts) {
                Ok(v) => break v,
                Err(e) if tries < DATA_CONNECT_TRIES => {
                    tracing_note(&format!("data connection attempt {tries}: {e}; retrying"));
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e).context("data connection"),
            }
        };
        self.ids.push(id);
        self.data_ready = Instant::now() + opts.first_fpdu_delay;
        Ok((version, describe(&info)))
    }

    fn accept(
        &mut self,
        bind: SocketAddr,
        ready: Option<Sender<SocketAddr>>,
    ) -> Result<(String, String)> {
        let opts = self.options(1);
        let l = self.ch.listen(
            bind,
            &ListenOptions::default().backlog(4).options(opts.clone()),
        )?;
        if let Some(tx) = ready {
            // The receiver may be gone (it stopped waiting): nothing to tell then.
            let _ = tx.send(l.local_addr());
        }
        let (id, _) = l
            .accept(&self.ctrl_qp, &opts, Some(self.p.accept_timeout))
            .context("waiting for the control connection")?;
        self.ids.push(id);
        let version = self.preamble()?;
        if self.p.shape.op == Op::Send {
            self.post_data_recvs(self.p.rx_window())?;
        }
        // The listener stays up: the client connects the data QP to the same port once the
        // zero destinations were exchanged.
        self.handshake(&Dest::default())?;
        let reads = self.data_reads();
        let (id, info) = l
            .accept(&self.data_qp, &self.options(reads), Some(STEP_TIMEOUT))
            .context("waiting for the data connection")?;
        self.ids.push(id);
        Ok((version, describe(&info)))
    }
}

impl Side {
    /// Ends the session. perftest tears its QPs down right after its last control message
    /// completes; closing ours first could flush a Send of the peer that we already
    /// received but whose completion it has not seen yet (siw then reports a failed
    /// Send). So the peer closes first: the server waits for the client's disconnect (a
    /// while), the client for the server's (briefly: the server may be waiting too), then
    /// each disconnects gracefully.
    fn close(&mut self) {
        let wait = if self.client {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(10)
        };
        let deadline = Instant::now() + wait;
        let conns: Vec<_> = self.ids.iter().map(|id| id.conn_id()).collect();
        let mut left = conns.clone();
        while !left.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match self.ch.get_event_matching(
                Some(deadline - now),
                |e| matches!(e, CmEvent::Disconnected { id, .. } if conns.contains(id)),
            ) {
                Ok(CmEvent::Disconnected { id, .. }) => left.retain(|c| *c != id),
                _ => break,
            }
        }
        for id in &self.ids {
            // Already disconnected by the peer: nothing to do.
            let _ = id.disconnect();
        }
    }
}

fn describe(info: &softwarp::ConnectionInfo) -> String {
    format!(
        "MPA rev {}, CRC {}, IRD/ORD {}/{}",
        info.revision,
        if info.crc { "on" } else { "off" },
        info.ird,
        info.ord
    )
}

fn tracing_note(s: &str) {
    eprintln!("softwarp bench -R: {s}");
}

fn finish(side: &mut Side, conn: String, peer_version: String) -> Result<Outcome> {
    let peer = side.handshakes_before()?;
    let (rows, report) = side.measure(&peer)?;
    side.close();
    Ok(Outcome {
        rows,
        peer_version,
        report,
        data_conn: conn,
    })
}

fn validate(p: &Params) -> Result<()> {
    ensure!(p.size >= 1, "-s must be at least 1 byte");
    ensure!(p.iters >= 1, "-n must be at least 1");
    ensure!(
        p.size <= u32::MAX as usize,
        "-s must be below 4 GiB (one SGE)"
    );
    ensure!(
        !p.bidir || p.shape.kind == Kind::Bw,
        "-b: perftest's latency tools have no bidirectional mode"
    );
    ensure!(
        !p.all || (p.size >= 2 && p.size.is_power_of_two()),
        "with -a the largest size must be a power of two of at least 2 bytes"
    );
    Ok(())
}

/// Runs one perftest session as the client of the perftest server at `addr`.
pub fn client(addr: SocketAddr, p: &Params) -> Result<Outcome> {
    validate(p)?;
    let mut side = Side::new(*p, true)?;
    let (version, conn) = side.connect(addr)?;
    finish(&mut side, conn, version)
}

/// Serves one perftest session on `bind`; `ready` learns the bound address.
pub fn server(bind: SocketAddr, p: &Params, ready: Option<Sender<SocketAddr>>) -> Result<Outcome> {
    validate(p)?;
    let mut side = Side::new(*p, false)?;
    let (version, conn) = side.accept(bind, ready)?;
    finish(&mut side, conn, version)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(size: usize, all: bool) -> Params {
        Params {
            shape: Shape::ALL[0],
            size,
            all,
            bidir: false,
            iters: 5,
            tx_depth: 1,
            rx_depth: 512,
            out_reads: 1,
            crc: false,
            busy: false,
            accept_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn all_sizes_are_the_powers_of_two_from_2_bytes_to_the_largest() {
        assert_eq!(params(3000, false).sizes(), vec![3000]);
        let a = params(8 << 20, true).sizes();
        assert_eq!(a.len(), 23, "perftest -a: 2 B .. 8 MiB");
        assert_eq!((a[0], a[22]), (2, 8 << 20));
        assert!(a.windows(2).all(|w| w[1] == 2 * w[0]));
        assert_eq!(params(16, true).sizes(), vec![2, 4, 8, 16]);
        assert!(validate(&params(3000, true)).is_err());
        assert!(validate(&params(1, true)).is_err());
        assert!(validate(&params(4096, true)).is_ok());
        // -n applies at every size (perftest -a: checked against ib_send_lat -a -n 5).
        assert_eq!(params(8 << 20, true).iters_at(2), 5);
        assert_eq!(params(8 << 20, true).iters_at(8 << 20), 5);
    }
}
