//! A stream rsocket: rdma-core's `rsocket.c` protocol for `SOCK_STREAM` on iWARP, over
//! Softwarp's verbs and connection manager.
//!
//! The data path is rdma-core's (`RS_OPT_MSG_SEND`, the mode it picks for an iWARP device):
//! each transfer is an RDMA Write into the peer's receive buffer at the address of the
//! peer's current target SGL entry, followed by a 4-byte Send carrying the message
//! (`RS_OP_DATA` and the length); credits and new receive-buffer halves go the same way
//! (an RDMA Write of an `rs_sge` into the peer's target SGL, then an `RS_OP_SGL` Send, or
//! the Send alone when no half is free); `RS_OP_CTRL` Sends say shutdown or disconnect.
//! The counters and their rules (`sseq_no`/`sseq_comp`, `rseq_no`/`rseq_comp`,
//! `ctrl_seqno`/`ctrl_max_seqno`, `sqe_avail`, the two receive-buffer halves) follow
//! rsocket.c so that either end can be rdma-core's.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use softwarp::{
    AccessFlags, CmEvent, CmEventChannel, CmId, CmListener, CompletionChannel, CompletionQueue,
    ConnectOptions, ConnectRequest, Device, ListenOptions, MemoryRegion, Payload, ProtectionDomain,
    QpCap, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, SgList, Sge, Stag, WcStatus,
    EMPTY_COMPLETION, MAX_INLINE,
};

use softwarp::cm::PortReservation;

use super::iomap::{self, IomapMr, Iomaps};
use super::wire::{self, ConnData, Op, RsSge};
use crate::errno;

/// `RS_OLAP_START_SIZE`: the first transfer of an `rsend`, doubled each time after.
const OLAP_START_SIZE: u32 = 2048;
/// `RS_MAX_TRANSFER`.
const MAX_TRANSFER: u32 = 65536;
/// `RS_SNDLOWAT`: the least free send buffer for a transfer.
pub const SNDLOWAT: u32 = 2048;
/// `RS_QP_MIN_SIZE`.
const QP_MIN_SIZE: u16 = 16;
/// `RS_QP_MAX_SIZE`.
pub const QP_MAX_SIZE: u32 = 0xFFFE;
/// `RS_QP_CTRL_SIZE`: control messages in flight at most.
const QP_CTRL_SIZE: u32 = 4;

/// `RS_WR_ID_FLAG_RECV`.
const WR_RECV: u64 = 1 << 63;
/// `RS_WR_ID_FLAG_MSG_SEND`: the Send that follows a Write.
const WR_MSG_SEND: u64 = 1 << 62;

/// rdma-core's defaults (`def_inline`, `def_sqsize`, `def_rqsize`, `def_mem`, `def_wmem`).
pub const DEF_INLINE: u16 = 64;
pub const DEF_SQSIZE: u16 = 384;
pub const DEF_RQSIZE: u16 = 384;
pub const DEF_MEM: u32 = 1 << 17;
pub const DEF_WMEM: u32 = 1 << 17;

/// `enum rs_state`: ordered passive, connecting, connected, disconnected.
pub mod state {
    pub const INIT: u32 = 0;
    pub const BOUND: u32 = 0x0001;
    pub const LISTENING: u32 = 0x0002;
    pub const OPENING: u32 = 0x0004;
    pub const CONNECTING: u32 = OPENING | 0x0040;
    pub const CONNECTED: u32 = 0x0100;
    pub const WRITABLE: u32 = 0x0200;
    pub const READABLE: u32 = 0x0400;
    pub const CONNECT_RDWR: u32 = CONNECTED | READABLE | WRITABLE;
    pub const CONNECT_ERROR: u32 = 0x0800;
    pub const DISCONNECTED: u32 = 0x1000;
    pub const ERROR: u32 = 0x2000;
}
use state::*;

/// What a caller waits for (rsocket.c's `test` functions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// `rs_conn_have_rdata`: data, or not readable any more.
    Readable,
    /// `rs_conn_can_send`: room to send, or not writable any more.
    Writable,
    /// `rs_conn_can_send_ctrl`: a control message slot, or not connected.
    CtrlSlot,
    /// `rs_conn_all_sends_done`.
    SendsDone,
    /// `rs_poll_all`: one pass.
    Once,
}

/// The settings a socket keeps before it has an endpoint (and a listener passes on).
#[derive(Debug, Clone)]
pub struct Sizes {
    pub sq_size: u16,
    pub rq_size: u16,
    pub sq_inline: u16,
    pub sbuf_size: u32,
    pub rbuf_size: u32,
    pub target_iomap_size: u16,
}

impl Default for Sizes {
    fn default() -> Self {
        Self {
            sq_size: DEF_SQSIZE,
            rq_size: DEF_RQSIZE,
            sq_inline: DEF_INLINE,
            sbuf_size: DEF_WMEM,
            rbuf_size: DEF_MEM,
            target_iomap_size: 0,
        }
    }
}

/// The verbs objects of a connected (or connecting) socket. Fields drop in order: the QP
/// (which closes its connection gracefully) before its CQ and memory.
pub struct Endpoint {
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub chan: CompletionChannel,
    /// The send buffer: data too large to be inline is copied here.
    smr: MemoryRegion,
    /// The target SGL (`RS_SGL_SIZE` entries) the peer writes new buffer halves into,
    /// then the iomap entries.
    target_mr: MemoryRegion,
    /// The receive buffer (`rbuf_size`), then one 4-byte message slot per receive.
    rmr: MemoryRegion,
    pub pd: ProtectionDomain,
}

/// The stream state of rsocket.c (`struct rsocket`'s data-stream half).
pub struct Stream {
    pub ep: Arc<Endpoint>,
    sizes: Sizes,
    ctrl_seqno: u32,
    ctrl_max_seqno: u32,
    sseq_no: u16,
    sseq_comp: u16,
    rseq_no: u16,
    rseq_comp: u16,
    remote_sge: u32,
    remote_sgl: RsSge,
    pub remote_iomap: RsSge,
    target_sge: usize,
    rbuf_msg_index: u32,
    rbuf_bytes_avail: u32,
    rbuf_free_offset: u32,
    rbuf_offset: u32,
    sbuf_bytes_avail: u32,
    /// `ssgl[0].addr` as an offset into the send buffer.
    ssgl_off: u32,
    sqe_avail: i64,
    /// Received messages not consumed: (opcode, data); data messages carry their length.
    rmsg: VecDeque<u32>,
    swap: bool,
    pub cq_armed: bool,
    /// This end's iomap windows.
    pub iomaps: Iomaps,
}

/// Everything of a socket behind its lock.
pub struct Inner {
    pub state: u32,
    pub fd_flags: c_int,
    pub err: c_int,
    pub sizes: Sizes,
    pub so_opts: u64,
    pub tcp_opts: u64,
    pub ipv6_opts: u64,
    pub route: Option<Vec<u8>>,
    pub bound: Option<SocketAddr>,
    /// The port `rbind` holds until `rlisten` listens on it (rdma_bind_addr's hold: port 0
    /// is chosen at the bind, `IPV6_V6ONLY` applies).
    pub reserved: Option<PortReservation>,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    pub cm: Option<Arc<CmEventChannel>>,
    pub listener: Option<CmListener>,
    pub pending: VecDeque<ConnectRequest>,
    pub backlog: u32,
    pub cm_id: Option<CmId>,
    pub s: Option<Stream>,
    /// A thread waits on the completion channel (the others wait on `changed`).
    pub waiting: bool,
    /// `SO_KEEPALIVE` is on (rdma-core's `RS_OPT_KEEPALIVE`).
    pub keepalive: bool,
    /// Seconds between keepalives (`TCP_KEEPIDLE`; 0: not set yet).
    pub keepalive_time: u32,
}

/// One stream rsocket.
pub struct Rsocket {
    pub family: c_int,
    pub inner: Mutex<Inner>,
    pub changed: Condvar,
    /// A datagram rsocket's UDP socket (its number too, as in rdma-core); `None` for a
    /// stream socket.
    pub udp: Option<std::os::fd::OwnedFd>,
}

pub fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn fail(call: &'static str, e: &softwarp::Error) -> c_int {
    errno::fail(call, e)
}

/// The size of a send's next transfer with `left` bytes to go: `olen`, which doubles up to
/// `RS_MAX_TRANSFER` for the one after, or what is left.
fn next_transfer(olen: &mut u32, left: usize) -> u32 {
    if (*olen as usize) < left {
        let x = *olen;
        if *olen < MAX_TRANSFER {
            *olen <<= 1;
        }
        x
    } else {
        left as u32
    }
}

/// The device the connection manager uses (the library's, opened once).
fn device() -> Result<&'static Device, c_int> {
    let ctx = crate::cm::cm_context()?;
    // SAFETY: `cm_context` is the library's context, never closed.
    let c = unsafe { crate::verbs::context::Context::from_ibv(ctx) }.ok_or(libc::ENODEV)?;
    Ok(&c.dev)
}

impl Rsocket {
    pub fn new(family: c_int, sizes: Sizes) -> Self {
        Self {
            family,
            inner: Mutex::new(Inner {
                state: INIT,
                fd_flags: 0,
                err: 0,
                sizes,
                so_opts: 0,
                tcp_opts: 0,
                ipv6_opts: 0,
                route: None,
                bound: None,
                reserved: None,
                local: None,
                peer: None,
                cm: None,
                listener: None,
                pending: VecDeque::new(),
                backlog: 0,
                cm_id: None,
                s: None,
                waiting: false,
                keepalive: false,
                keepalive_time: 0,
            }),
            changed: Condvar::new(),
            udp: None,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }
}

impl Endpoint {
    /// `rs_create_ep`'s verbs half: sizes clamped as `rs_set_qp_size` does, the CQ armed
    /// on a channel, the RC QP with every send signalled, the three registrations.
    fn create(sizes: &mut Sizes) -> Result<Self, c_int> {
        let dev = device()?;
        let max = (dev.query().max_qp_wr.min(QP_MAX_SIZE as usize)) as u16;
        sizes.sq_size = sizes.sq_size.clamp(QP_MIN_SIZE, max);
        sizes.rq_size = sizes.rq_size.clamp(QP_MIN_SIZE, max);
        let pd = dev.alloc_pd().map_err(|e| fail("rsocket", &e))?;
        let chan = dev.create_comp_channel().map_err(|e| fail("rsocket", &e))?;
        let cq = dev
            .create_cq(
                usize::from(sizes.sq_size) + usize::from(sizes.rq_size),
                Some(&chan),
            )
            .map_err(|e| fail("rsocket", &e))?;
        // Control messages (up to an `rs_sge`) always go inline.
        let inline = usize::from(sizes.sq_inline).clamp(wire::SGE_LEN, MAX_INLINE);
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.cap = QpCap {
            max_send_wr: usize::from(sizes.sq_size),
            max_recv_wr: usize::from(sizes.rq_size),
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: inline,
        };
        attr.sq_sig_all = true;
        let qp = pd.create_qp(&attr).map_err(|e| fail("rsocket", &e))?;
        sizes.sq_inline = inline as u16;
        let lw = AccessFlags::LOCAL_WRITE;
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let smr = pd
            .reg_mr(sizes.sbuf_size as usize, lw)
            .map_err(|e| fail("rsocket", &e))?;
        let target_len =
            wire::SGE_LEN * wire::SGL_SIZE + wire::IOMAP_LEN * usize::from(sizes.target_iomap_size);
        let target_mr = pd.reg_mr(target_len, rw).map_err(|e| fail("rsocket", &e))?;
        let rbuf_len = sizes.rbuf_size as usize + usize::from(sizes.rq_size) * wire::MSG_SIZE;
        let rmr = pd.reg_mr(rbuf_len, rw).map_err(|e| fail("rsocket", &e))?;
        Ok(Self {
            qp,
            cq,
            chan,
            smr,
            target_mr,
            rmr,
            pd,
        })
    }
}

impl Stream {
    /// `rs_create_ep` after the QP: buffers initialised as `rs_init_bufs` does and every
    /// receive posted.
    pub fn create(sizes: &mut Sizes) -> Result<Self, c_int> {
        let ep = Endpoint::create(sizes)?;
        let mut s = Self {
            ep: Arc::new(ep),
            sizes: sizes.clone(),
            ctrl_seqno: 0,
            ctrl_max_seqno: QP_CTRL_SIZE,
            sseq_no: 0,
            sseq_comp: 0,
            rseq_no: 0,
            rseq_comp: sizes.rq_size >> 1,
            remote_sge: 0,
            remote_sgl: RsSge::default(),
            remote_iomap: RsSge::default(),
            target_sge: 0,
            rbuf_msg_index: 0,
            rbuf_bytes_avail: sizes.rbuf_size >> 1,
            rbuf_free_offset: sizes.rbuf_size >> 1,
            rbuf_offset: 0,
            sbuf_bytes_avail: sizes.sbuf_size,
            ssgl_off: 0,
            sqe_avail: i64::from(sizes.sq_size) - i64::from(QP_CTRL_SIZE),
            rmsg: VecDeque::with_capacity(usize::from(sizes.rq_size) + 1),
            swap: false,
            cq_armed: false,
            iomaps: Iomaps::default(),
        };
        s.ep.cq.req_notify(false).map_err(|e| fail("rsocket", &e))?;
        for _ in 0..sizes.rq_size {
            s.post_recv()?;
        }
        Ok(s)
    }

    /// `rs_format_conn_data`.
    pub fn conn_data(&self) -> ConnData {
        let ep = &self.ep;
        ConnData {
            version: wire::VERSION,
            flags: wire::FLAG_IOMAP | if wire::HOST_IS_NET { wire::FLAG_NET } else { 0 },
            credits: self.sizes.rq_size,
            target_iomap_size: wire::value_to_scale(u32::from(self.sizes.target_iomap_size), 8)
                as u8,
            target_sgl: RsSge {
                addr: ep.target_mr.addr(),
                key: ep.target_mr.rkey().0,
                length: wire::SGL_SIZE as u32,
            },
            data_buf: RsSge {
                addr: ep.rmr.addr(),
                key: ep.rmr.rkey().0,
                length: self.sizes.rbuf_size >> 1,
            },
        }
    }

    /// `rs_save_conn_data`.
    pub fn save_conn_data(&mut self, c: &ConnData) -> Result<(), c_int> {
        self.remote_sgl = c.target_sgl;
        self.remote_sge = 1;
        self.swap = c.needs_swap();
        if c.flags & wire::FLAG_IOMAP != 0 {
            self.remote_iomap = RsSge {
                addr: c
                    .target_sgl
                    .addr
                    .wrapping_add(wire::SGE_LEN as u64 * u64::from(c.target_sgl.length)),
                length: wire::scale_to_value(u32::from(c.target_iomap_size), 8),
                key: c.target_sgl.key,
            };
        }
        self.set_target(0, c.data_buf)?;
        self.sseq_comp = c.credits;
        Ok(())
    }

    fn target(&self, i: usize) -> RsSge {
        let mut b = [0u8; wire::SGE_LEN];
        // The entry is inside the registration (created with RS_SGL_SIZE entries).
        if self
            .ep
            .target_mr
            .read_at(i * wire::SGE_LEN, &mut b)
            .is_err()
        {
            return RsSge::default();
        }
        RsSge::from_bytes(&b)
    }

    fn set_target(&self, i: usize, sge: RsSge) -> Result<(), c_int> {
        self.ep
            .target_mr
            .write_at(i * wire::SGE_LEN, &sge.to_bytes(false))
            .map_err(|e| fail("rsocket", &e))
    }

    fn post(&self, wr: &SendWr<'_>) -> Result<(), c_int> {
        self.ep
            .qp
            .post_send(wr)
            .map_err(|e| fail("rsocket post_send", &e))
    }

    /// `rs_post_recv` in message-send mode: a 4-byte slot per receive, round robin.
    fn post_recv(&mut self) -> Result<(), c_int> {
        let off = self.sizes.rbuf_size as usize + self.rbuf_msg_index as usize * wire::MSG_SIZE;
        let sge = self
            .ep
            .rmr
            .sge(off, wire::MSG_SIZE as u32)
            .map_err(|e| fail("rsocket post_recv", &e))?;
        let wr = RecvWr {
            wr_id: WR_RECV | u64::from(self.rbuf_msg_index),
            sgl: SgList::single(sge),
        };
        self.rbuf_msg_index += 1;
        if self.rbuf_msg_index == u32::from(self.sizes.rq_size) {
            self.rbuf_msg_index = 0;
        }
        self.ep
            .qp
            .post_recv(&wr)
            .map_err(|e| fail("rsocket post_recv", &e))
    }

    /// `rs_post_msg`: a message alone, an inline Send.
    fn post_msg(&self, m: u32) -> Result<(), c_int> {
        self.post_msg_as(u64::from(m), m)
    }

    /// [`Self::post_msg`] with the work request id `wr_id`.
    fn post_msg_as(&self, wr_id: u64, m: u32) -> Result<(), c_int> {
        let bytes = wire::msg_bytes(m);
        self.post(&SendWr {
            wr_id,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Inline(&bytes),
            signaled: true,
            fence: false,
        })
    }

    /// `rs_post_write_msg` in message-send mode: the Write, then the message's Send.
    fn post_write_msg(
        &self,
        payload: Payload<'_>,
        m: u32,
        addr: u64,
        rkey: u32,
    ) -> Result<(), c_int> {
        self.post(&SendWr {
            wr_id: u64::from(m),
            op: SendOp::Write {
                remote_addr: addr,
                rkey: Stag(rkey),
            },
            payload,
            signaled: true,
            fence: false,
        })?;
        self.post_msg_as(u64::from(wire::msg(wire::msg_op(m), 0)) | WR_MSG_SEND, m)
    }

    fn ctrl_avail(&self) -> bool {
        self.ctrl_seqno != self.ctrl_max_seqno
    }

    /// `rs_2ctrl_avail`: message-send mode needs two slots (Write and Send).
    fn two_ctrl_avail(&self) -> bool {
        (self
            .ctrl_seqno
            .wrapping_add(1)
            .wrapping_sub(self.ctrl_max_seqno) as i32)
            < 0
    }

    /// `rs_send_credits`.
    fn send_credits(&mut self) -> Result<(), c_int> {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.rseq_comp = self.rseq_no.wrapping_add(self.sizes.rq_size >> 1);
        let credits = u32::from(self.rseq_no) + u32::from(self.sizes.rq_size);
        let half = self.sizes.rbuf_size >> 1;
        if self.rbuf_bytes_avail >= half {
            self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
            let sge = RsSge {
                addr: self.ep.rmr.addr() + u64::from(self.rbuf_free_offset),
                key: self.ep.rmr.rkey().0,
                length: half,
            };
            let bytes = sge.to_bytes(self.swap);
            let addr = self
                .remote_sgl
                .addr
                .wrapping_add(u64::from(self.remote_sge) * wire::SGE_LEN as u64);
            let r = self.post_write_msg(
                Payload::Inline(&bytes),
                wire::msg(Op::Sgl, credits),
                addr,
                self.remote_sgl.key,
            );
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset += half;
            if self.rbuf_free_offset >= self.sizes.rbuf_size {
                self.rbuf_free_offset = 0;
            }
            self.remote_sge += 1;
            if self.remote_sge == self.remote_sgl.length {
                self.remote_sge = 0;
            }
            r
        } else {
            self.post_msg(wire::msg(Op::Sgl, credits))
        }
    }

    /// `rs_give_credits`.
    fn give_credits(&self, state: u32) -> bool {
        (self.rbuf_bytes_avail >= (self.sizes.rbuf_size >> 1)
            || (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) >= 0)
            && self.two_ctrl_avail()
            && state & CONNECTED != 0
    }

    /// `rs_can_send` (message-send mode).
    /// Receive-side and send-side counts for an edge-triggered readiness (see
    /// `poll::edges`): messages arrived or consumed; sends completed and buffer returned.
    pub fn edge_counts(&self) -> (u64, u64) {
        let rx = u64::from(self.rseq_no) | (self.rmsg.len() as u64) << 16;
        let tx = u64::from(self.sseq_comp)
            | u64::from(self.sbuf_bytes_avail) << 16
            | (self.sqe_avail as u64 & 0xffff) << 40;
        (rx, tx)
    }

    pub fn can_send(&self) -> bool {
        self.sqe_avail >= 2
            && self.sbuf_bytes_avail >= SNDLOWAT
            && self.sseq_no != self.sseq_comp
            && self.target(self.target_sge).length != 0
    }

    pub fn have_rdata(&self) -> bool {
        !self.rmsg.is_empty()
    }

    fn all_sends_done(&self) -> bool {
        i64::from(self.ctrl_max_seqno) - i64::from(self.ctrl_seqno) + self.sqe_avail
            == i64::from(self.sizes.sq_size)
    }
}

impl Inner {
    fn stream(&mut self) -> Result<&mut Stream, c_int> {
        self.s.as_mut().ok_or(libc::ENOTCONN)
    }

    /// `rs_update_credits`.
    pub fn update_credits(&mut self) {
        let state = self.state;
        if let Some(s) = self.s.as_mut() {
            if s.give_credits(state) && s.send_credits().is_err() && state & CONNECTED != 0 {
                self.state = ERROR;
                self.err = libc::EIO;
            }
        }
    }

    /// `rs_poll_cq`: every completion processed. A receive flushed while connected means
    /// the peer's connection ended without a disconnect message (rdma-core would wait on):
    /// the socket becomes disconnected, its received data still readable.
    pub fn poll_cq(&mut self) -> Result<(), c_int> {
        let Some(s) = self.s.as_mut() else {
            return Ok(());
        };
        let mut wcs = [EMPTY_COMPLETION; 32];
        let mut rcnt = 0u32;
        let mut flushed = false;
        loop {
            let n = match s.ep.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    self.state = ERROR;
                    self.err = fail("rsocket poll_cq", &e);
                    return Err(self.err);
                }
            };
            for wc in &wcs[..n] {
                if wc.wr_id & WR_RECV != 0 {
                    if wc.status != WcStatus::Success {
                        flushed = true;
                        continue;
                    }
                    rcnt += 1;
                    let idx = (wc.wr_id & 0xFFFF_FFFF) as usize;
                    let mut b = [0u8; wire::MSG_SIZE];
                    let off = s.sizes.rbuf_size as usize + idx * wire::MSG_SIZE;
                    if s.ep.rmr.read_at(off, &mut b).is_err() {
                        continue;
                    }
                    let m = wire::msg_from_bytes(b);
                    match wire::msg_op(m) {
                        Op::Sgl => s.sseq_comp = wire::msg_data(m) as u16,
                        Op::IomapSgl | Op::Write => {}
                        Op::Ctrl => match wire::msg_data(m) {
                            wire::CTRL_DISCONNECT => {
                                self.state = DISCONNECTED;
                                return Ok(());
                            }
                            wire::CTRL_SHUTDOWN => {
                                if self.state & WRITABLE != 0 {
                                    self.state &= !READABLE;
                                } else {
                                    self.state = DISCONNECTED;
                                    return Ok(());
                                }
                            }
                            _ => {}
                        },
                        Op::Data | Op::Reserved(_) => s.rmsg.push_back(m),
                    }
                } else {
                    let data = (wc.wr_id & 0xFFFF_FFFF) as u32;
                    match wire::msg_op(data) {
                        Op::Sgl => s.ctrl_max_seqno = s.ctrl_max_seqno.wrapping_add(1),
                        Op::Ctrl => {
                            s.ctrl_max_seqno = s.ctrl_max_seqno.wrapping_add(1);
                            if wire::msg_data(data) == wire::CTRL_DISCONNECT {
                                self.state = DISCONNECTED;
                            }
                        }
                        Op::IomapSgl => {
                            s.sqe_avail += 1;
                            if wc.wr_id & WR_MSG_SEND == 0 {
                                s.sbuf_bytes_avail += wire::IOMAP_LEN as u32;
                            }
                        }
                        _ => {
                            s.sqe_avail += 1;
                            s.sbuf_bytes_avail += wire::msg_data(data);
                        }
                    }
                    if wc.status != WcStatus::Success && self.state & CONNECTED != 0 {
                        self.state = ERROR;
                        self.err = libc::EIO;
                    }
                }
            }
            if n < wcs.len() {
                break;
            }
        }
        if flushed && self.state & CONNECTED != 0 {
            // The connection ended without rsocket's disconnect message (an rsocket peer
            // always sends one before it closes): the peer died or the connection was
            // reset. Reported once as `ECONNRESET` by the next receive that finds no data
            // (and by `SO_ERROR`), then as the end of the stream.
            self.state = DISCONNECTED;
            self.err = libc::ECONNRESET;
        }
        if self.state & CONNECTED != 0 {
            for _ in 0..rcnt {
                if let Err(e) = s.post_recv() {
                    self.state = ERROR;
                    self.err = e;
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    pub fn test(&self, until: Until) -> bool {
        let Some(s) = self.s.as_ref() else {
            return true;
        };
        match until {
            Until::Readable => s.have_rdata() || self.state & READABLE == 0,
            Until::Writable => s.can_send() || self.state & WRITABLE == 0,
            Until::CtrlSlot => s.ctrl_avail() || self.state & CONNECTED == 0,
            Until::SendsDone => s.all_sends_done() || self.state & CONNECTED == 0,
            Until::Once => true,
        }
    }
}

impl Rsocket {
    /// `rs_get_comp`/`rs_process_cq`: completions processed until `until` holds; without
    /// waiting when `nonblock` (`EWOULDBLOCK`). One thread at a time waits on the completion
    /// channel; the others wait for it to have processed what woke it.
    pub fn process<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        nonblock: bool,
        until: Until,
    ) -> (MutexGuard<'a, Inner>, Result<(), c_int>) {
        loop {
            g.update_credits();
            let polled = g.poll_cq();
            if g.test(until) {
                g.update_credits();
                return (g, Ok(()));
            }
            if let Err(e) = polled {
                return (g, Err(e));
            }
            if nonblock {
                return (g, Err(libc::EWOULDBLOCK));
            }
            if g.waiting {
                g = self.changed.wait(g).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let Some(s) = g.s.as_mut() else {
                return (g, Ok(()));
            };
            if !s.cq_armed {
                if let Err(e) = s.ep.cq.req_notify(false) {
                    let e = fail("rsocket", &e);
                    return (g, Err(e));
                }
                s.cq_armed = true;
                continue;
            }
            let chan = s.ep.chan.clone();
            g.update_credits();
            g.waiting = true;
            drop(g);
            let r = chan.get_cq_event(None);
            g = self.lock();
            g.waiting = false;
            self.changed.notify_all();
            match r {
                Ok(_) => {
                    if let Some(s) = g.s.as_mut() {
                        s.cq_armed = false;
                    }
                }
                Err(e) => {
                    g.state = ERROR;
                    let e = fail("rsocket wait", &e);
                    return (g, Err(e));
                }
            }
        }
    }

    /// `rs_do_connect` for the states after `rconnect` started: the connection attempt's
    /// outcome, without waiting when `nonblock` (`EINPROGRESS` then).
    pub fn do_connect<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        nonblock: bool,
    ) -> (MutexGuard<'a, Inner>, Result<(), c_int>) {
        match g.state {
            CONNECTING => {}
            CONNECT_ERROR | DISCONNECTED | ERROR => return (g, Err(libc::ENOTCONN)),
            st if st & CONNECTED != 0 => return (g, Ok(())),
            _ => return (g, Err(libc::EINVAL)),
        }
        let (Some(cm), Some(id)) = (g.cm.clone(), g.cm_id.as_ref().map(CmId::conn_id)) else {
            return (g, Err(libc::EINVAL));
        };
        let ends = |e: &CmEvent| e.conn_id() == Some(id) && e.ends_attempt();
        let ev = if nonblock {
            match cm.get_event_matching(Some(std::time::Duration::ZERO), ends) {
                Ok(ev) => ev,
                Err(_) => return (g, Err(libc::EINPROGRESS)),
            }
        } else {
            drop(g);
            let r = cm.get_event_matching(None, ends);
            g = self.lock();
            if g.state != CONNECTING {
                // Another thread settled it meanwhile.
                return self.do_connect(g, nonblock);
            }
            match r {
                Ok(ev) => ev,
                Err(e) => {
                    let e = fail("rconnect", &e);
                    return self.connect_failed(g, e);
                }
            }
        };
        let r = match ev {
            CmEvent::Established { info, .. } => {
                g.local = Some(info.local_addr);
                g.peer = Some(info.peer_addr);
                match ConnData::parse(&info.peer_private_data) {
                    Ok(c) => match g.stream().and_then(|s| s.save_conn_data(&c)) {
                        Ok(()) => {
                            g.state = CONNECT_RDWR;
                            Ok(())
                        }
                        Err(e) => Err(e),
                    },
                    Err(why) => {
                        tracing::debug!(target: "softwarp::verbs", ?why, "rconnect: the peer is not an rsocket");
                        Err(libc::ENOTSUP)
                    }
                }
            }
            CmEvent::Rejected { .. } => Err(libc::ECONNREFUSED),
            CmEvent::Unreachable { error, .. } | CmEvent::ConnectError { error, .. } => {
                Err(fail("rconnect", &error))
            }
            _ => Err(libc::ECONNREFUSED),
        };
        match r {
            Ok(()) => (g, Ok(())),
            Err(e) => self.connect_failed(g, e),
        }
    }

    fn connect_failed<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        e: c_int,
    ) -> (MutexGuard<'a, Inner>, Result<(), c_int>) {
        g.state = CONNECT_ERROR;
        g.err = e;
        (g, Err(e))
    }

    /// `rconnect`: the endpoint, the connection data in the MPA Request, the attempt. Called
    /// again, it answers as rdma-core's `rs_do_connect` (not as the kernel): `EINPROGRESS`
    /// while a non-blocking attempt runs, 0 once connected. librspreload's `connect` gives
    /// the program any other error after moving the socket to plain TCP, and hiredis
    /// (redis-cli) calls `connect` again after `poll` says the socket is writable.
    pub fn connect(&self, addr: SocketAddr) -> Result<(), c_int> {
        let mut g = self.lock();
        match g.state {
            INIT | BOUND => {}
            st if st & (OPENING | CONNECTED) != 0 => {
                let nonblock = g.fd_flags & libc::O_NONBLOCK != 0;
                return self.do_connect(g, nonblock).1;
            }
            LISTENING => return Err(libc::EINVAL),
            _ => return Err(libc::ENOTCONN),
        }
        let cm = match CmEventChannel::new() {
            Ok(c) => Arc::new(c),
            Err(e) => return Err(fail("rconnect", &e)),
        };
        let mut sizes = g.sizes.clone();
        let s = match Stream::create(&mut sizes) {
            Ok(s) => s,
            Err(e) => return self.connect_failed(g, e).1,
        };
        g.sizes = sizes;
        let mut opts: ConnectOptions = crate::env::options();
        opts.private_data = s.conn_data().to_bytes().to_vec();
        // rdma-core: "work-around: iWarp issues RDMA read during connection".
        opts.ird = Some(0);
        opts.ord = Some(1);
        let id = match cm.connect(&s.ep.qp, addr, &opts) {
            Ok(id) => id,
            Err(e) => {
                let e = fail("rconnect", &e);
                return self.connect_failed(g, e).1;
            }
        };
        g.peer = Some(addr);
        g.s = Some(s);
        g.cm = Some(cm);
        g.cm_id = Some(id);
        g.state = CONNECTING;
        let nonblock = g.fd_flags & libc::O_NONBLOCK != 0;
        self.do_connect(g, nonblock).1
    }

    /// `rlisten`.
    pub fn listen(&self, backlog: c_int) -> Result<(), c_int> {
        let mut g = self.lock();
        if g.state == LISTENING {
            return Ok(());
        }
        if g.state != INIT && g.state != BOUND {
            return Err(libc::EINVAL);
        }
        let addr = g.bound.unwrap_or_else(|| match self.family {
            libc::AF_INET6 => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
            _ => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        });
        let cm = CmEventChannel::new().map_err(|e| fail("rlisten", &e))?;
        let opts = ListenOptions::default()
            .backlog(backlog.max(1) as u32)
            .options(crate::env::options());
        let l = match g.reserved.take() {
            Some(port) => cm.listen_reserved(port, &opts),
            None => cm.listen(addr, &opts),
        }
        .map_err(|e| fail("rlisten", &e))?;
        g.local = Some(l.local_addr());
        g.listener = Some(l);
        g.cm = Some(Arc::new(cm));
        g.backlog = backlog.max(1) as u32;
        g.state = LISTENING;
        Ok(())
    }

    /// Moves the connection requests waiting on a listener's channel into its queue (other
    /// events of the channel, about accepted connections, are dropped: their sockets learn
    /// of a disconnection from their own queues).
    pub fn drain_requests(g: &mut Inner) {
        let Some(cm) = g.cm.clone() else {
            return;
        };
        while let Some(ev) = cm.try_get_event() {
            if let CmEvent::ConnectRequest(r) = ev {
                g.pending.push_back(r);
            }
        }
    }

    /// `raccept`'s work (rdma-core's `rs_accept`): the next request's connection data
    /// checked, an endpoint made, the Reply sent with ours. A request that is not an
    /// rsocket's is rejected and the next one taken.
    pub fn accept(&self) -> Result<Rsocket, c_int> {
        loop {
            let mut g = self.lock();
            if g.state != LISTENING {
                return Err(libc::EBADF);
            }
            Self::drain_requests(&mut g);
            let sizes = g.sizes.clone();
            let req = match g.pending.pop_front() {
                Some(r) => r,
                None => {
                    if g.fd_flags & libc::O_NONBLOCK != 0 {
                        return Err(libc::EAGAIN);
                    }
                    let Some(cm) = g.cm.clone() else {
                        return Err(libc::EBADF);
                    };
                    drop(g);
                    match cm.get_event_matching(None, |e| matches!(e, CmEvent::ConnectRequest(_))) {
                        Ok(CmEvent::ConnectRequest(r)) => r,
                        Ok(_) => continue,
                        Err(e) => return Err(fail("raccept", &e)),
                    }
                }
            };
            let creq = match ConnData::parse(req.private_data()) {
                Ok(c) => c,
                Err(why) => {
                    tracing::debug!(target: "softwarp::verbs", ?why, peer = %req.peer_addr(), "raccept: not an rsocket's request, rejected");
                    let _ = req.reject(&[]);
                    continue;
                }
            };
            let new = Rsocket::new(self.family, sizes);
            {
                let mut ng = new.lock();
                let mut sizes = ng.sizes.clone();
                let mut s = match Stream::create(&mut sizes) {
                    Ok(s) => s,
                    Err(_) => {
                        let _ = req.reject(&[]);
                        continue;
                    }
                };
                ng.sizes = sizes;
                if s.save_conn_data(&creq).is_err() {
                    let _ = req.reject(&[]);
                    continue;
                }
                let mut opts: ConnectOptions = crate::env::options();
                opts.private_data = s.conn_data().to_bytes().to_vec();
                // rdma_accept with the request's parameters: our IRD is the initiator's
                // ORD and our ORD its IRD.
                if let Some((ird, ord)) = req.peer_ird_ord() {
                    opts.ird = Some(usize::from(ord));
                    opts.ord = Some(usize::from(ird));
                }
                match req.accept(&s.ep.qp, &opts) {
                    Ok(id) => {
                        ng.local = id
                            .connection()
                            .map(|c| c.local_addr)
                            .or(Some(req.local_addr()));
                        ng.peer = Some(req.peer_addr());
                        ng.cm_id = Some(id);
                        ng.s = Some(s);
                        ng.state = CONNECT_RDWR;
                    }
                    Err(e) => {
                        tracing::debug!(target: "softwarp::verbs", error = %e, "raccept: the accept failed");
                        continue;
                    }
                }
            }
            return Ok(new);
        }
    }

    /// The start of `rrecv` and `rsend`: a connection in progress is carried on (`EAGAIN`
    /// while a non-blocking one still is), a socket without one is `ENOTCONN`. Returns
    /// the lock and whether the transfer may not block (`O_NONBLOCK`, `MSG_DONTWAIT`).
    fn transfer_start(&self, flags: c_int) -> Result<(MutexGuard<'_, Inner>, bool), c_int> {
        let mut g = self.lock();
        if g.state & OPENING != 0 {
            let nonblock = g.fd_flags & libc::O_NONBLOCK != 0;
            let (ng, r) = self.do_connect(g, nonblock);
            g = ng;
            if let Err(e) = r {
                return Err(if e == libc::EINPROGRESS {
                    libc::EAGAIN
                } else {
                    e
                });
            }
        }
        if g.s.is_none() {
            return Err(libc::ENOTCONN);
        }
        let nonblock = g.fd_flags & libc::O_NONBLOCK != 0 || flags & libc::MSG_DONTWAIT != 0;
        Ok((g, nonblock))
    }

    /// Waits for room to send (`rs_can_send`); `ECONNRESET` once the socket is no longer
    /// writable.
    fn wait_writable<'a>(
        &'a self,
        g: MutexGuard<'a, Inner>,
        nonblock: bool,
    ) -> (MutexGuard<'a, Inner>, Result<(), c_int>) {
        if g.s.as_ref().is_some_and(Stream::can_send) {
            return (g, Ok(()));
        }
        let (g, r) = self.process(g, nonblock, Until::Writable);
        if r.is_ok() && g.state & WRITABLE == 0 {
            return (g, Err(libc::ECONNRESET));
        }
        (g, r)
    }

    /// `rrecv` (stream semantics; also `rread`, `rrecvfrom`, the first vector of `rreadv`).
    pub fn recv(&self, buf: &mut [u8], flags: c_int) -> Result<usize, c_int> {
        let (mut g, nonblock) = self.transfer_start(flags)?;
        let len = buf.len();
        let mut left = len;
        let mut ret = Ok(());
        loop {
            if !g.s.as_ref().is_some_and(Stream::have_rdata) {
                let (ng, r) = self.process(g, nonblock, Until::Readable);
                g = ng;
                if let Err(e) = r {
                    ret = Err(e);
                    break;
                }
            }
            let Some(s) = g.s.as_mut() else { break };
            if flags & libc::MSG_PEEK != 0 {
                left = len - s.peek(buf);
                break;
            }
            while left > 0 && s.have_rdata() {
                let off = len - left;
                let head = s.rmsg[0];
                let head_len = wire::msg_data(head) as usize;
                let rsize = if left < head_len {
                    s.rmsg[0] = wire::msg(wire::msg_op(head), (head_len - left) as u32);
                    left
                } else {
                    s.rseq_no = s.rseq_no.wrapping_add(1);
                    s.rmsg.pop_front();
                    head_len
                };
                s.copy_out(&mut buf[off..off + rsize]);
                left -= rsize;
            }
            if !(left > 0 && flags & libc::MSG_WAITALL != 0 && g.state & READABLE != 0) {
                break;
            }
        }
        // A connection lost without a disconnect message: the receive that finds nothing
        // more says so once, as TCP's read after a reset.
        if ret.is_ok()
            && left == len
            && len > 0
            && g.err == libc::ECONNRESET
            && g.state & READABLE == 0
            && !g.s.as_ref().is_some_and(Stream::have_rdata)
        {
            g.err = 0;
            ret = Err(libc::ECONNRESET);
        }
        drop(g);
        match ret {
            Err(e) if left == len => Err(e),
            _ => Ok(len - left),
        }
    }

    /// `rsend`/`rsendv` (stream semantics): transfers of growing size (2 KiB doubling up
    /// to 64 KiB), each bounded by the free send buffer and the peer's current target
    /// entry; inline from the caller's buffer when it fits, else copied into the send
    /// buffer (two SGEs where it wraps).
    pub fn send(&self, iov: &[&[u8]], flags: c_int) -> Result<usize, c_int> {
        let (mut g, nonblock) = self.transfer_start(flags)?;
        if g.s.as_ref().is_some_and(|s| !s.iomaps.queue.is_empty()) {
            let (ng, r) = self.send_iomaps(g, nonblock);
            g = ng;
            r?;
        }
        let len: usize = iov.iter().map(|b| b.len()).sum();
        let mut left = len;
        let mut olen = OLAP_START_SIZE;
        let mut cur = Gather {
            iov,
            idx: 0,
            off: 0,
        };
        let mut ret = Ok(());
        while left > 0 {
            let (ng, r) = self.wait_writable(g, nonblock);
            g = ng;
            if let Err(e) = r {
                ret = Err(e);
                break;
            }
            let Some(s) = g.s.as_mut() else {
                ret = Err(libc::ENOTCONN);
                break;
            };
            let mut xfer = next_transfer(&mut olen, left);
            xfer = xfer
                .min(s.sbuf_bytes_avail)
                .min(s.target(s.target_sge).length);
            if let Err(e) = s.write_data(&mut cur, xfer) {
                ret = Err(e);
                break;
            }
            left -= xfer as usize;
        }
        drop(g);
        match ret {
            Err(e) if left == len => Err(e),
            _ => Ok(len - left),
        }
    }

    /// `rs_send_iomaps`: every queued mapping written into the peer's table, waiting for
    /// room to send as `rsend` does.
    fn send_iomaps<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        nonblock: bool,
    ) -> (MutexGuard<'a, Inner>, Result<(), c_int>) {
        loop {
            if g.s.as_ref().is_none_or(|s| s.iomaps.queue.is_empty()) {
                return (g, Ok(()));
            }
            if !g.s.as_ref().is_some_and(Stream::can_send) {
                let (ng, r) = self.process(g, nonblock, Until::Writable);
                g = ng;
                if let Err(e) = r {
                    return (g, Err(e));
                }
                if g.state & WRITABLE == 0 {
                    return (g, Err(libc::ECONNRESET));
                }
            }
            let Some(s) = g.s.as_mut() else {
                return (g, Err(libc::ENOTCONN));
            };
            let Some(m) = s.iomaps.queue.pop_front() else {
                continue;
            };
            let r = match m.index {
                Some(i) => s.write_iomap(&m, i),
                None => Ok(()),
            };
            s.iomaps.list.push(m);
            if let Err(e) = r {
                return (g, Err(e));
            }
        }
    }

    /// `riomap`: `len` bytes at `buf` registered; with `PROT_WRITE` given an entry of the
    /// peer's table and queued to be sent (by the next `rsend` or `riowrite`). Returns the
    /// offset the peer addresses it by (`offset`, or the address when -1).
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes until `riounmap` or `rclose` returns; the peer
    /// may write it at any time while it is mapped for writing.
    pub unsafe fn riomap(
        &self,
        buf: *mut u8,
        len: usize,
        prot: c_int,
        offset: i64,
    ) -> Result<i64, c_int> {
        let (access, remote) = iomap::access(prot)?;
        let mut g = self.lock();
        let Some(s) = g.s.as_mut() else {
            return Err(libc::EINVAL);
        };
        let index = if remote {
            let entries = s.remote_iomap.length as usize;
            Some(s.iomaps.free_index(entries).ok_or(libc::ENOMEM)?)
        } else {
            None
        };
        // SAFETY: the caller's contract (this function's) is reg_mr_raw's.
        let mr = match unsafe { s.ep.pd.reg_mr_raw(buf, len, access) } {
            Ok(mr) => mr,
            Err(e) => {
                if let Some(i) = index {
                    if let Some(u) = s.iomaps.used.get_mut(i) {
                        *u = false;
                    }
                }
                return Err(fail("riomap", &e));
            }
        };
        let offset = if offset == -1 {
            buf as usize as i64
        } else {
            offset
        };
        let m = IomapMr {
            offset: offset as u64,
            mr,
            addr: buf as usize,
            len,
            index,
        };
        if remote {
            s.iomaps.queue.push_back(m);
        } else {
            s.iomaps.list.push(m);
        }
        Ok(offset)
    }

    /// `riounmap`: the mapping of exactly `buf`, `len` deregistered (`EINVAL` if there is
    /// none); returns once nothing uses its memory.
    pub fn riounmap(&self, buf: usize, len: usize) -> Result<(), c_int> {
        let m = {
            let mut g = self.lock();
            let s = g.s.as_mut().ok_or(libc::EINVAL)?;
            s.iomaps.take(buf, len).ok_or(libc::EINVAL)?
        };
        iomap::release(m);
        Ok(())
    }

    /// Every mapping released (`rclose`).
    pub fn release_iomaps(&self) {
        let all = {
            let mut g = self.lock();
            g.s.as_mut().map(|s| s.iomaps.drain()).unwrap_or_default()
        };
        for m in all {
            iomap::release(m);
        }
    }

    /// `riowrite`: `buf` RDMA-written into the peer's mappings from `offset` on, as far as
    /// they reach (transfers sized as `rsend`'s, cut at the mapping's end).
    pub fn riowrite(&self, buf: &[u8], mut offset: u64, flags: c_int) -> Result<usize, c_int> {
        let mut g = self.lock();
        if g.s.is_none() {
            return Err(libc::ENOTCONN);
        }
        let nonblock = g.fd_flags & libc::O_NONBLOCK != 0 || flags & libc::MSG_DONTWAIT != 0;
        if g.s.as_ref().is_some_and(|s| !s.iomaps.queue.is_empty()) {
            let (ng, r) = self.send_iomaps(g, nonblock);
            g = ng;
            r?;
        }
        let count = buf.len();
        let mut left = count;
        let mut olen = OLAP_START_SIZE;
        let parts = [buf];
        let mut cur = Gather {
            iov: &parts,
            idx: 0,
            off: 0,
        };
        let mut iom: Option<(u64, RsSge)> = None;
        let mut ret = Ok(());
        while left > 0 {
            if iom.is_none_or(|(o, sge)| offset > o + u64::from(sge.length)) {
                iom = g.s.as_ref().and_then(|s| s.find_iomap(offset));
                if iom.is_none() {
                    break;
                }
            }
            let (ng, r) = self.wait_writable(g, nonblock);
            g = ng;
            if let Err(e) = r {
                ret = Err(e);
                break;
            }
            let (Some(s), Some((o, sge))) = (g.s.as_mut(), iom) else {
                break;
            };
            let mut xfer = next_transfer(&mut olen, left);
            xfer = xfer.min(s.sbuf_bytes_avail);
            let room = (o + u64::from(sge.length)).saturating_sub(offset);
            xfer = xfer.min(u32::try_from(room).unwrap_or(u32::MAX));
            if xfer == 0 {
                break;
            }
            let addr = sge.addr.wrapping_add(offset - o);
            if let Err(e) = s.write_direct(&mut cur, xfer, addr, sge.key) {
                ret = Err(e);
                break;
            }
            left -= xfer as usize;
            offset += u64::from(xfer);
        }
        drop(g);
        match ret {
            Err(e) if left == count => Err(e),
            _ => Ok(count - left),
        }
    }

    /// `tcp_svc_send_keepalive`: `RS_CTRL_KEEPALIVE` as a zero-length RDMA Write to STag
    /// 0, offset 0, when a control slot is free and the socket is connected.
    pub fn send_keepalive(&self) {
        let mut g = self.lock();
        let connected = g.state & CONNECTED != 0;
        if let Some(s) = g.s.as_mut() {
            if s.ctrl_avail() && connected {
                s.ctrl_seqno = s.ctrl_seqno.wrapping_add(1);
                let m = wire::msg(Op::Ctrl, wire::CTRL_KEEPALIVE);
                let _ = s.post(&SendWr {
                    wr_id: u64::from(m),
                    op: SendOp::Write {
                        remote_addr: 0,
                        rkey: Stag(0),
                    },
                    payload: Payload::Sgl(SgList::new()),
                    signaled: true,
                    fence: false,
                });
            }
        }
    }

    /// `rshutdown`.
    pub fn shutdown(&self, how: c_int) -> Result<(), c_int> {
        let keepalive = self.lock().keepalive;
        if keepalive {
            super::keepalive::remove(self);
        }
        let mut g = self.lock();
        let mut ret = Ok(());
        'out: {
            if g.state & CONNECTED != 0 {
                let ctrl = match how {
                    libc::SHUT_RDWR => {
                        g.state &= !(READABLE | WRITABLE);
                        wire::CTRL_DISCONNECT
                    }
                    libc::SHUT_WR => {
                        g.state &= !WRITABLE;
                        if g.state & READABLE != 0 {
                            wire::CTRL_SHUTDOWN
                        } else {
                            wire::CTRL_DISCONNECT
                        }
                    }
                    libc::SHUT_RD => {
                        g.state &= !READABLE;
                        if g.state & WRITABLE != 0 {
                            break 'out;
                        }
                        wire::CTRL_DISCONNECT
                    }
                    _ => return Err(libc::EINVAL),
                };
                if !g.s.as_ref().is_some_and(Stream::ctrl_avail) {
                    let (ng, r) = self.process(g, false, Until::CtrlSlot);
                    g = ng;
                    if let Err(e) = r {
                        ret = Err(e);
                        break 'out;
                    }
                }
                if g.state & CONNECTED != 0 {
                    if let Some(s) = g.s.as_mut() {
                        if s.ctrl_avail() {
                            s.ctrl_seqno = s.ctrl_seqno.wrapping_add(1);
                            ret = s.post_msg(wire::msg(Op::Ctrl, ctrl));
                        }
                    }
                }
            }
            if g.state & CONNECTED != 0 {
                let (ng, _) = self.process(g, false, Until::SendsDone);
                g = ng;
            }
        }
        if g.state & DISCONNECTED != 0 {
            if let Some(s) = g.s.as_ref() {
                // Receives flush, waking whoever waits on the socket.
                let _ = s.ep.cq.req_notify(false);
                if s.ep.qp.disconnect().is_ok() {
                    // A program may exit now without `rclose`: the exit waits for the
                    // graceful close (`closing.rs`).
                    super::closing::register(&s.ep);
                }
            }
        }
        ret
    }
}

/// A position in an `iovec` list being gathered from (`rs_copy_iov`).
struct Gather<'a, 'b> {
    iov: &'a [&'b [u8]],
    idx: usize,
    off: usize,
}

impl Gather<'_, '_> {
    /// The next `len` bytes as slices (at most as many as the vectors they span).
    fn take(&mut self, mut len: usize, mut f: impl FnMut(&[u8])) {
        while len > 0 && self.idx < self.iov.len() {
            let v = self.iov[self.idx];
            let n = (v.len() - self.off).min(len);
            f(&v[self.off..self.off + n]);
            self.off += n;
            len -= n;
            if self.off == v.len() {
                self.idx += 1;
                self.off = 0;
            }
        }
    }

    /// The next bytes as one slice if they lie in one vector.
    fn contiguous(&self, len: usize) -> Option<&[u8]> {
        let v = self.iov.get(self.idx)?;
        (v.len() - self.off >= len).then(|| &v[self.off..self.off + len])
    }

    fn skip(&mut self, len: usize) {
        self.take(len, |_| {});
    }
}

impl Stream {
    fn sbuf_left(&self) -> u32 {
        self.sizes.sbuf_size - self.ssgl_off
    }

    /// Copies the next `len` bytes of `cur` into the send buffer at `off`.
    fn copy_in(&self, cur: &mut Gather<'_, '_>, mut off: usize, len: usize) -> Result<(), c_int> {
        let mut r = Ok(());
        cur.take(len, |chunk| {
            if r.is_ok() {
                r = self.ep.smr.write_at(off, chunk);
                off += chunk.len();
            }
        });
        r.map_err(|e| fail("rsend", &e))
    }

    /// `rs_write_data` with the choice of inline, one or two SGEs that precedes it.
    fn write_data(&mut self, cur: &mut Gather<'_, '_>, xfer: u32) -> Result<(), c_int> {
        let t = self.target(self.target_sge);
        let (addr, rkey) = (t.addr, t.key);
        let rest = RsSge {
            addr: t.addr.wrapping_add(u64::from(xfer)),
            key: t.key,
            length: t.length - xfer,
        };
        self.set_target(self.target_sge, rest)?;
        if rest.length == 0 {
            self.target_sge = (self.target_sge + 1) % wire::SGL_SIZE;
        }
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 2;
        self.sbuf_bytes_avail -= xfer;
        let m = wire::msg(Op::Data, xfer);
        self.with_payload(cur, xfer, |s, p| s.post_write_msg(p, m, addr, rkey))
    }

    /// The next `xfer` bytes of `cur` as a work request's payload, handed to `post`:
    /// inline from the caller's buffer when they fit the inline size, else copied into the
    /// send buffer (one SGE, or two where it wraps), as rsocket.c's `rsend` chooses.
    fn with_payload(
        &mut self,
        cur: &mut Gather<'_, '_>,
        xfer: u32,
        post: impl FnOnce(&Self, Payload<'_>) -> Result<(), c_int>,
    ) -> Result<(), c_int> {
        let len = xfer as usize;
        if len <= usize::from(self.sizes.sq_inline) {
            if let Some(data) = cur.contiguous(len) {
                let r = post(self, Payload::Inline(data));
                cur.skip(len);
                return r;
            }
        }
        let left = self.sbuf_left();
        let start = self.ssgl_off;
        let sgl = if xfer <= left {
            self.copy_in(cur, start as usize, len)?;
            let sge = self.sge(start, xfer)?;
            self.ssgl_off = if xfer < left { start + xfer } else { 0 };
            SgList::single(sge)
        } else {
            self.copy_in(cur, start as usize, left as usize)?;
            let second = xfer - left;
            self.copy_in(cur, 0, second as usize)?;
            let a = self.sge(start, left)?;
            let b = self.sge(0, second)?;
            self.ssgl_off = second;
            SgList::from_slice(&[a, b]).ok_or(libc::EINVAL)?
        };
        post(self, Payload::Sgl(sgl))
    }

    /// `rs_write_direct`: `xfer` bytes RDMA-written into the peer's mapping at `addr`
    /// (no message; one work request).
    fn write_direct(
        &mut self,
        cur: &mut Gather<'_, '_>,
        xfer: u32,
        addr: u64,
        rkey: u32,
    ) -> Result<(), c_int> {
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= xfer;
        let m = wire::msg(Op::Write, xfer);
        self.with_payload(cur, xfer, |s, p| {
            s.post(&SendWr {
                wr_id: u64::from(m),
                op: SendOp::Write {
                    remote_addr: addr,
                    rkey: Stag(rkey),
                },
                payload: p,
                signaled: true,
                fence: false,
            })
        })
    }

    /// `rs_write_iomap`: a mapping's `rs_iomap` written into the peer's table entry, then
    /// `RS_OP_IOMAP_SGL` with the index.
    fn write_iomap(&mut self, m: &IomapMr, index: usize) -> Result<(), c_int> {
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 2;
        self.sbuf_bytes_avail -= wire::IOMAP_LEN as u32;
        let sge = RsSge {
            addr: m.mr.addr(),
            key: m.mr.rkey().0,
            length: m.len as u32,
        };
        let bytes = iomap::iomap_bytes(m.offset, sge, self.swap);
        let addr = self
            .remote_iomap
            .addr
            .wrapping_add((index * wire::IOMAP_LEN) as u64);
        self.post_write_msg(
            Payload::Inline(&bytes),
            wire::msg(Op::IomapSgl, index as u32),
            addr,
            self.remote_iomap.key,
        )
    }

    /// `rs_find_iomap`: the entry of our table (written by the peer) that holds `offset`.
    fn find_iomap(&self, offset: u64) -> Option<(u64, RsSge)> {
        let base = wire::SGE_LEN * wire::SGL_SIZE;
        (0..usize::from(self.sizes.target_iomap_size)).find_map(|i| {
            let mut b = [0u8; wire::IOMAP_LEN];
            self.ep
                .target_mr
                .read_at(base + i * wire::IOMAP_LEN, &mut b)
                .ok()?;
            let (o, sge) = iomap::iomap_from_bytes(&b);
            (offset >= o && offset < o.wrapping_add(u64::from(sge.length))).then_some((o, sge))
        })
    }

    fn sge(&self, off: u32, len: u32) -> Result<Sge, c_int> {
        self.ep
            .smr
            .sge(off as usize, len)
            .map_err(|e| fail("rsend", &e))
    }

    /// Copies the head of the receive buffer out (wrapping at its end) and frees it.
    fn copy_out(&mut self, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let end = (self.sizes.rbuf_size - self.rbuf_offset) as usize;
            let n = (out.len() - done).min(end);
            let _ = self
                .ep
                .rmr
                .read_at(self.rbuf_offset as usize, &mut out[done..done + n]);
            done += n;
            self.rbuf_offset += n as u32;
            if self.rbuf_offset == self.sizes.rbuf_size {
                self.rbuf_offset = 0;
            }
            self.rbuf_bytes_avail += n as u32;
        }
    }

    /// `rs_peek`: the data waiting, copied without being consumed.
    fn peek(&self, out: &mut [u8]) -> usize {
        let mut off = self.rbuf_offset;
        let mut done = 0;
        for m in &self.rmsg {
            if done == out.len() {
                break;
            }
            let mut n = (wire::msg_data(*m) as usize).min(out.len() - done);
            while n > 0 {
                let end = (self.sizes.rbuf_size - off) as usize;
                let k = n.min(end);
                let _ = self.ep.rmr.read_at(off as usize, &mut out[done..done + k]);
                done += k;
                n -= k;
                off += k as u32;
                if off == self.sizes.rbuf_size {
                    off = 0;
                }
            }
        }
        done
    }
}
