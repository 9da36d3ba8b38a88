//! The measurement of each shape, as perftest runs it (see the module docs of `perftest`),
//! on the data QP of a [`Side`] whose exchange has reached the data phase. No control
//! messages here.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use softwarp::{Payload, SendOp, SendWr, SgList, Stag, WcOpcode, MAX_INLINE};

use super::wire::{self, BwReport, Dest};
use super::{check, Side, SizeRow, CREDIT_WRITES_MAX, STEP_TIMEOUT};
use crate::rdma::elapsed_ns;
use crate::session::{Rtt, Timed};
use crate::spec::{Kind, Op};
use crate::{cpu, spin};

/// How far [`Side::post_window`] may post.
#[derive(Debug, Clone, Copy)]
struct Limits {
    iters: u64,
    window: u64,
    rx_window: u64,
}

impl Side {
    fn poll_data(&mut self, send: bool) -> Result<usize> {
        let cq = if send { &self.data_scq } else { &self.data_rcq };
        let n = cq.poll(&mut self.wcs)?;
        for wc in &self.wcs[..n] {
            check(wc, "data QP")?;
        }
        Ok(n)
    }

    /// Polls the send CQ until `outstanding` more completions came (bounded by `deadline`,
    /// then the error `what`).
    fn wait_sends(&mut self, mut outstanding: u64, deadline: Instant, what: &str) -> Result<()> {
        let mut spins = 0u32;
        while outstanding > 0 {
            outstanding = outstanding.saturating_sub(self.poll_data(true)? as u64);
            spin::wait_step(&mut spins, deadline, || what.to_string())?;
        }
        Ok(())
    }

    /// RDMA Writes `got` (messages received so far) into the peer's credit word, as
    /// perftest's send_bw receiver does (signaled, `wr_id` = `got`).
    fn post_credit(&self, peer: &Dest, got: u64) -> Result<()> {
        let word = wire::encode_credit(u32::try_from(got).unwrap_or(u32::MAX));
        self.data_qp.post_send(&SendWr {
            wr_id: got,
            op: SendOp::Write {
                remote_addr: peer.vaddr,
                rkey: Stag(peer.rkey),
            },
            payload: Payload::Inline(&word),
            signaled: true,
            fence: false,
        })?;
        Ok(())
    }

    fn data_wr(&self, peer: &Dest, op: Op, wr_id: u64) -> Result<SendWr<'static>> {
        let data = self.data()?;
        let len = u32::try_from(self.cur)?;
        let (op, sge) = match op {
            Op::Write => (
                SendOp::Write {
                    remote_addr: peer.vaddr,
                    rkey: Stag(peer.rkey),
                },
                data.sge(self.half, len)?,
            ),
            Op::Read => (
                SendOp::Read {
                    remote_addr: peer.vaddr,
                    rkey: Stag(peer.rkey),
                },
                data.sge(0, len)?,
            ),
            Op::Send => (
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                data.sge(self.half, len)?,
            ),
        };
        Ok(SendWr {
            wr_id,
            op,
            payload: Payload::Sgl(SgList::single(sge)),
            signaled: true,
            fence: false,
        })
    }

    /// Posts the shape's operations while fewer than `window` are outstanding (`posted -
    /// done`) and `iters` are not all posted, and for Sends while fewer than `rx_window` are
    /// uncredited (perftest: post only while scnt + 1 - credit < rx_depth); true when it
    /// posted any.
    fn post_window(
        &mut self,
        peer: &Dest,
        posted: &mut u64,
        done: u64,
        limits: Limits,
    ) -> Result<bool> {
        let op = self.p.shape.op;
        let mut word = [0u8; 4];
        let mut progressed = false;
        while *posted < limits.iters && posted.saturating_sub(done) < limits.window {
            if op == Op::Send {
                self.credit.read_at(0, &mut word)?;
                let credit = u64::from(wire::decode_credit(&word)?);
                if *posted + 1 >= credit + limits.rx_window {
                    break;
                }
            }
            let wr = self.data_wr(peer, op, *posted)?;
            self.data_qp.post_send(&wr)?;
            *posted += 1;
            progressed = true;
        }
        Ok(progressed)
    }

    /// The active side of a bandwidth shape: `iters` operations, `window` outstanding, and
    /// for Sends fewer than `rx_window` uncredited. Returns the elapsed time.
    fn bw_active(&mut self, peer: &Dest) -> Result<Duration> {
        let op = self.p.shape.op;
        let iters = self.iters();
        let mut window = self.p.tx_depth.max(1) as u64;
        if op == Op::Read {
            window = window
                .min(peer.out_reads.max(1) as u64)
                .min(self.p.out_reads as u64);
        }
        let rx_window = self.p.rx_window();
        let limits = Limits {
            iters,
            window,
            rx_window,
        };
        let (mut posted, mut done) = (0u64, 0u64);
        let start = Instant::now();
        let deadline = start + STEP_TIMEOUT.max(Duration::from_secs(600));
        let mut spins = 0u32;
        while done < iters {
            let progressed = self.post_window(peer, &mut posted, done, limits)?;
            let n = self.poll_data(true)?;
            done += n as u64;
            if n == 0 && !progressed {
                spin::wait_step(&mut spins, deadline, || {
                    format!(
                        "{}: {done} of {iters} operations completed, then nothing",
                        self.p.shape
                    )
                })?;
            }
        }
        Ok(start.elapsed())
    }

    /// send_bw, write_bw and read_bw with `-b` (perftest's `run_iter_bi` for Sends,
    /// `run_iter_bw` on both ends otherwise): this side posts `iters` operations as the
    /// active side does, and for Sends also receives the peer's `iters`, reposting receives
    /// and RDMA Writing its count into the peer's credit word every `rx_window / 3`. As in
    /// perftest, the server's first Send waits for its first receive. Returns the time
    /// until both directions are done here.
    fn bw_bidir(&mut self, peer: &Dest) -> Result<Duration> {
        let op = self.p.shape.op;
        if op != Op::Send {
            return self.bw_active(peer);
        }
        let iters = self.iters();
        let window = self.p.tx_depth.max(1) as u64;
        let rx_window = self.p.rx_window();
        let every = (rx_window / 3).max(1);
        let limits = Limits {
            iters,
            window,
            rx_window,
        };
        let (mut posted, mut done, mut got, mut reposted) = (0u64, 0u64, 0u64, rx_window);
        let mut writes = 0u64;
        let mut may_send = self.client;
        let start = Instant::now();
        let deadline = start + STEP_TIMEOUT.max(Duration::from_secs(600));
        let mut spins = 0u32;
        while done < iters || got < iters || writes > 0 {
            let progressed = may_send && self.post_window(peer, &mut posted, done, limits)?;
            let n = self.poll_data(true)?;
            for wc in &self.wcs[..n] {
                if wc.opcode == WcOpcode::RdmaWrite {
                    writes = writes.saturating_sub(1);
                } else {
                    done += 1;
                }
            }
            let r = self.poll_data(false)?;
            if r > 0 {
                may_send = true;
            }
            for _ in 0..r {
                got += 1;
                if reposted < iters {
                    self.post_data_recvs(1)?;
                    reposted += 1;
                }
                if got.is_multiple_of(every) {
                    // Room in the send queue for the credit Write.
                    let mut waits = 0u32;
                    while writes >= CREDIT_WRITES_MAX as u64 {
                        let n = self.poll_data(true)?;
                        for wc in &self.wcs[..n] {
                            if wc.opcode == WcOpcode::RdmaWrite {
                                writes = writes.saturating_sub(1);
                            } else {
                                done += 1;
                            }
                        }
                        spin::wait_step(&mut waits, deadline, || {
                            "send_bw -b: credit Writes never completed".to_string()
                        })?;
                    }
                    self.post_credit(peer, got)?;
                    writes += 1;
                }
            }
            if n == 0 && r == 0 && !progressed {
                spin::wait_step(&mut spins, deadline, || {
                    format!("send_bw -b: {done} of {iters} Sends completed and {got} of {iters} received, then nothing")
                })?;
            }
        }
        Ok(start.elapsed())
    }

    /// The receiver of send_bw: reposts receives up to `iters` and RDMA Writes the count of
    /// received messages into the sender's credit word every `rx_window / 3` receives.
    /// Returns the time from the first to the last receive.
    fn send_bw_passive(&mut self, peer: &Dest) -> Result<Duration> {
        let iters = self.iters();
        let rx_window = self.p.rx_window();
        let every = (rx_window / 3).max(1);
        let mut posted = rx_window;
        let mut got = 0u64;
        let mut first = None;
        let deadline = Instant::now() + STEP_TIMEOUT.max(Duration::from_secs(600));
        let mut spins = 0u32;
        let mut writes = 0u64;
        while got < iters {
            let n = self.poll_data(false)?;
            if n == 0 {
                self.poll_data(true)?;
                spin::wait_step(&mut spins, deadline, || {
                    format!("send_bw: {got} of {iters} messages received, then nothing")
                })?;
                continue;
            }
            first.get_or_insert_with(Instant::now);
            for _ in 0..n {
                got += 1;
                if posted < iters {
                    self.post_data_recvs(1)?;
                    posted += 1;
                }
                if got.is_multiple_of(every) {
                    self.post_credit(peer, got)?;
                    writes += 1;
                }
            }
            // Take the credit Writes' completions so the send queue never fills.
            if writes > 0 {
                writes = writes.saturating_sub(self.poll_data(true)? as u64);
            }
        }
        // Every credit Write has left before the handshake that ends the size (with -a
        // the sender zeroes its credit word for the next size after that).
        self.wait_sends(writes, deadline, "send_bw: credit Writes never completed")?;
        Ok(first.map_or(Duration::ZERO, |t| t.elapsed()))
    }

    fn send_one(&mut self, peer: &Dest, i: u64) -> Result<()> {
        let wr = self.data_wr(peer, Op::Send, i)?;
        self.data_qp.post_send(&wr)?;
        Ok(())
    }

    fn wait_recv(&mut self, deadline: Instant) -> Result<()> {
        let mut spins = 0u32;
        loop {
            let n = self.poll_data(false)?;
            if n > 0 {
                ensure!(n == 1, "send_lat: {n} messages at once");
                return self.post_data_recvs(1);
            }
            self.poll_data(true)?;
            spin::wait_step(&mut spins, deadline, || {
                "send_lat: no message from the peer".to_string()
            })?;
        }
    }

    /// send_lat: the client sends, the server answers, `iters` times. Round trips (ns) as
    /// the client sees them (the server: from its answer to the next message).
    fn send_lat(&mut self, peer: &Dest) -> Result<Vec<u64>> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        let mut samples = Vec::with_capacity(self.iters() as usize);
        let mut t = Instant::now();
        for i in 0..self.iters() {
            if self.client {
                t = Instant::now();
                self.send_one(peer, i)?;
                self.wait_recv(deadline)?;
                samples.push(elapsed_ns(t));
            } else {
                self.wait_recv(deadline)?;
                if i > 0 {
                    samples.push(elapsed_ns(t));
                }
                t = Instant::now();
                self.send_one(peer, i)?;
            }
        }
        Ok(samples)
    }

    /// write_lat as perftest runs it: the server writes first; each side waits for the
    /// last byte of its buffer to read the count of Writes received (mod 256), then writes
    /// its own count. Round trips from each Write to the next arrival.
    fn write_lat(&mut self, peer: &Dest) -> Result<Vec<u64>> {
        let size = self.cur;
        let iters = self.iters();
        let deadline = Instant::now() + STEP_TIMEOUT;
        let mut samples = Vec::with_capacity(iters as usize);
        let (mut scnt, mut rcnt) = (0u64, 0u64);
        let mut last_write: Option<Instant> = None;
        let mut byte = [0u8; 1];
        let mut outstanding = 0u64;
        while scnt < iters || rcnt < iters {
            // The server does not wait before its first Write.
            if rcnt < iters && (self.client || scnt >= 1) {
                rcnt += 1;
                let want = rcnt as u8;
                let mut spins = 0u32;
                loop {
                    self.data()?.read_at(size - 1, &mut byte)?;
                    if byte[0] == want {
                        break;
                    }
                    outstanding = outstanding.saturating_sub(self.poll_data(true)? as u64);
                    spin::wait_step(&mut spins, deadline, || {
                        format!("write_lat: Write {rcnt} of {iters} never arrived")
                    })?;
                }
                if let Some(t) = last_write.take() {
                    samples.push(elapsed_ns(t));
                }
            }
            if scnt < iters {
                scnt += 1;
                let stamp = [scnt as u8];
                let wr = self.data_wr(peer, Op::Write, scnt)?;
                if size <= MAX_INLINE {
                    let mut inline = vec![0u8; size];
                    inline[size - 1] = stamp[0];
                    self.data_qp.post_send(&SendWr {
                        payload: Payload::Inline(&inline),
                        ..wr
                    })?;
                } else {
                    self.data()?.write_at(self.half + size - 1, &stamp)?;
                    self.data_qp.post_send(&wr)?;
                }
                last_write = Some(Instant::now());
                outstanding += 1;
            }
            outstanding = outstanding.saturating_sub(self.poll_data(true)? as u64);
        }
        // The last Write must have left before the connection goes away (every data WR
        // is signalled).
        self.wait_sends(outstanding, deadline, "write_lat: Writes never completed")?;
        Ok(samples)
    }

    /// read_lat: the client's Reads, one at a time.
    fn read_lat(&mut self, peer: &Dest) -> Result<Vec<u64>> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        let mut samples = Vec::with_capacity(self.iters() as usize);
        for i in 0..self.iters() {
            let t = Instant::now();
            let wr = self.data_wr(peer, Op::Read, i)?;
            self.data_qp.post_send(&wr)?;
            let mut spins = 0u32;
            while self.poll_data(true)? == 0 {
                spin::wait_step(&mut spins, deadline, || {
                    format!("read_lat: Read {i} never completed")
                })?;
            }
            samples.push(elapsed_ns(t));
        }
        Ok(samples)
    }

    /// Iterations at the current size.
    pub(super) fn iters(&self) -> u64 {
        self.p.iters_at(self.cur)
    }

    /// The measurement of one size (`self.cur`): this side's figures, and the client's
    /// report in write_bw and read_bw.
    fn measure_size(&mut self, peer: &Dest) -> Result<(Option<Timed>, Option<BwReport>)> {
        let p = self.p;
        let (size, iters) = (self.cur, self.iters());
        let cpu0 = cpu::process_cpu_secs();
        let lat = |ns: Vec<u64>| -> Option<Timed> {
            let secs = ns.iter().sum::<u64>() as f64 / 1e9;
            let rtt = Rtt::of(&ns)?;
            // Row's figures divide the time by the iterations: scale to all of them.
            let scale = iters as f64 / ns.len().max(1) as f64;
            Some(Timed {
                secs: secs * scale,
                cpu: 0.0,
                rtt: Some(rtt),
                bytes: 0,
            })
        };
        let bw = |d: Duration| Timed {
            secs: d.as_secs_f64(),
            cpu: 0.0,
            rtt: None,
            bytes: size as u64 * iters,
        };
        let (timed, mine) = match (p.shape.kind, p.shape.op, self.client || p.bidir) {
            (Kind::Bw, _, true) => {
                let d = if p.bidir {
                    self.bw_bidir(peer)?
                } else {
                    self.bw_active(peer)?
                };
                let secs = d.as_secs_f64().max(1e-9);
                let mb = (size as f64 * iters as f64) / secs / f64::from(1u32 << 20);
                let report = BwReport {
                    size: size as u64,
                    iters,
                    bw_peak: mb,
                    bw_avg: mb,
                    msg_rate: iters as f64 / secs / 1e6,
                };
                (Some(bw(d)), Some(report))
            }
            (Kind::Bw, Op::Send, false) => (Some(bw(self.send_bw_passive(peer)?)), None),
            (Kind::Bw, _, false) => (None, None),
            (Kind::Lat, Op::Send, _) => (lat(self.send_lat(peer)?), None),
            (Kind::Lat, Op::Write, _) => (lat(self.write_lat(peer)?), None),
            (Kind::Lat, Op::Read, true) => (lat(self.read_lat(peer)?), None),
            (Kind::Lat, Op::Read, false) => (None, None),
        };
        // This process's CPU time over the measurement (both ends on loopback; with a
        // perftest peer, ours only).
        let cpu = cpu::process_cpu_secs() - cpu0;
        Ok((timed.map(|t| Timed { cpu, ..t }), mine))
    }

    /// The measurement of every size and the closing exchange: one row per size (the
    /// passive server of write_bw and read_bw: one, from the client's report).
    pub(super) fn measure(&mut self, peer: &Dest) -> Result<(Vec<SizeRow>, Option<BwReport>)> {
        // Keep the first-FPDU hold-off of the data connection out of the measurement.
        let hold = self.data_ready.saturating_duration_since(Instant::now());
        if !hold.is_zero() {
            std::thread::sleep(hold);
        }
        let sync = self.sync_before_run();
        let send_bw = (self.p.shape.kind, self.p.shape.op) == (Kind::Bw, Op::Send);
        let bidir = self.p.bidir;
        let mine_dest = self.my_dest()?;
        let mut rows = Vec::new();
        let mut last = None;
        for (i, size) in self.p.sizes().into_iter().enumerate() {
            self.cur = size;
            if send_bw && i > 0 && (bidir || !self.client) {
                // perftest -a, send_bw: the receiver posts its receives for the size before
                // the handshake (the first size's were posted at the connection).
                self.post_data_recvs(self.p.rx_window())?;
            }
            if sync {
                self.handshake(&mine_dest)?;
            }
            if send_bw {
                // ... and after the handshake zeroes its credit word: the peer counts each
                // size's receives from 0.
                self.credit.write_at(0, &[0u8; 4])?;
            }
            let (timed, mine) = self.measure_size(peer)?;
            let mut row_timed = timed;
            if bidir {
                // -b: the version handshake of perftest >= 4.6 after each size of -a in
                // write_bw/read_bw, then both exchange their reports (send_bw: before its
                // handshake after the size). The row adds both directions up, as perftest's
                // full report does.
                if self.p.all && !send_bw {
                    self.handshake(&mine_dest)?;
                }
                let theirs = self.xchg_report(&mine.unwrap_or_default())?;
                row_timed = timed.map(|t| both_directions(t, mine.as_ref(), &theirs));
                last = Some(theirs);
            }
            if self.p.all && send_bw {
                // -a, send_bw: one more handshake after each size.
                self.handshake(&mine_dest)?;
            }
            if let Some(t) = row_timed {
                rows.push(SizeRow {
                    size,
                    iters: self.iters(),
                    timed: t,
                });
            }
            if !bidir {
                last = mine.or(last);
            }
        }
        if bidir {
            self.handshakes_after(None)?;
            return Ok((rows, last));
        }
        // write_bw and read_bw exchange one report at the end: the last size's.
        let theirs = self.handshakes_after(last)?;
        // The passive server of write_bw and read_bw reports the client's figures, as
        // perftest's does.
        if let (true, Some(r)) = (rows.is_empty(), theirs) {
            if r.bw_avg > 0.0 && r.size > 0 {
                rows.push(SizeRow {
                    size: usize::try_from(r.size)?,
                    iters: r.iters,
                    timed: Timed {
                        secs: (r.size as f64 * r.iters as f64) / (r.bw_avg * f64::from(1u32 << 20)),
                        cpu: 0.0,
                        rtt: None,
                        bytes: 0,
                    },
                });
            }
        }
        Ok((rows, if self.client { last } else { theirs }))
    }
}

/// A `-b` row: both directions added up, as perftest's full report adds the two sides'
/// average MB/s; the time is what carries `2 * size * iters` bytes at that rate (the row
/// counts both directions of a bidirectional shape).
fn both_directions(t: Timed, mine: Option<&BwReport>, theirs: &BwReport) -> Timed {
    let mine_avg = mine.map_or(0.0, |r| r.bw_avg);
    let sum = mine_avg + theirs.bw_avg;
    match mine {
        Some(r) if sum.is_finite() && sum > 0.0 && theirs.bw_avg >= 0.0 => Timed {
            secs: 2.0 * (r.size as f64 * r.iters as f64) / (sum * f64::from(1u32 << 20)),
            ..t
        },
        _ => t,
    }
}
