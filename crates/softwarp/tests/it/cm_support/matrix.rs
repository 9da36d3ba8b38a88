//! The negotiation matrix shared by `cm_matrix` and `cm_capture`: the cases, an oracle of
//! their outcome written from RFC 5044 and RFC 6581 (not from the library's negotiation
//! code), and a runner that connects both ends through the connection manager, checks what
//! they report, moves data both ways and disconnects.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp::*;

use super::*;

use crate::util::*;

/// One end's settings.
#[derive(Debug, Clone, Copy)]
pub struct EndCfg {
    pub rev: MpaRevision,
    pub crc: CrcMode,
    pub markers: MarkerMode,
}

#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub init: EndCfg,
    pub resp: EndCfg,
    /// RTR type offered (only with revision 2 at both ends).
    pub rtr: Option<RtrKind>,
    /// Private data size class: 0, 1 or the most a frame carries.
    pub pd: PdSize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdSize {
    Empty,
    One,
    Max,
}

pub fn pd_len(size: PdSize, rev: MpaRevision) -> usize {
    match size {
        PdSize::Empty => 0,
        PdSize::One => 1,
        // RFC 5044: PD_Length <= 512; RFC 6581 takes 4 of them for IRD/ORD in revision 2.
        PdSize::Max => match rev {
            MpaRevision::Rev1 => 512,
            MpaRevision::Rev2 => 508,
        },
    }
}

/// What the RFCs say the case must end with.
#[derive(Debug, PartialEq, Eq)]
pub enum Expect {
    /// Established, with the initiator's view (the responder's is its mirror).
    Up {
        revision: u8,
        crc: bool,
        /// Markers in what the initiator sends / receives.
        markers_tx: bool,
        markers_rx: bool,
        rtr: Option<RtrKind>,
    },
    /// The responder refuses the Request (reject Reply): it asked for markers the
    /// responder will not send.
    Rejected,
    /// The initiator refuses the Reply: the responder asks for markers the initiator will
    /// not send.
    InitiatorRefuses,
}

pub fn oracle(c: &Case) -> Expect {
    // M asks the other side to insert markers; MarkerMode::Off refuses to.
    if c.init.markers == MarkerMode::Request && c.resp.markers == MarkerMode::Off {
        return Expect::Rejected;
    }
    if c.resp.markers == MarkerMode::Request && c.init.markers == MarkerMode::Off {
        return Expect::InitiatorRefuses;
    }
    let revision = c.init.rev.min(c.resp.rev).value();
    Expect::Up {
        revision,
        // CRC is used when either side asks for it.
        crc: c.init.crc != CrcMode::Off || c.resp.crc != CrcMode::Off,
        markers_tx: c.resp.markers == MarkerMode::Request,
        markers_rx: c.init.markers == MarkerMode::Request,
        // The responder accepts every type, so it picks the one offered.
        rtr: c.rtr,
    }
}

pub fn cases(markers: &[MarkerMode]) -> Vec<Case> {
    let revs = [MpaRevision::Rev1, MpaRevision::Rev2];
    let crcs = [CrcMode::Off, CrcMode::Preferred, CrcMode::Required];
    let mut out = Vec::new();
    for &ir in &revs {
        for &rr in &revs {
            let rtrs: &[Option<RtrKind>] = if ir == MpaRevision::Rev2 && rr == MpaRevision::Rev2 {
                &[
                    None,
                    Some(RtrKind::Write),
                    Some(RtrKind::Read),
                    Some(RtrKind::Send),
                ]
            } else {
                &[None]
            };
            for &ic in &crcs {
                for &rc in &crcs {
                    for &im in markers {
                        for &rm in markers {
                            for &rtr in rtrs {
                                for pd in [PdSize::Empty, PdSize::One, PdSize::Max] {
                                    out.push(Case {
                                        init: EndCfg {
                                            rev: ir,
                                            crc: ic,
                                            markers: im,
                                        },
                                        resp: EndCfg {
                                            rev: rr,
                                            crc: rc,
                                            markers: rm,
                                        },
                                        rtr,
                                        pd,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Every marker mode.
pub fn marker_modes() -> Vec<MarkerMode> {
    vec![MarkerMode::Off, MarkerMode::Accept, MarkerMode::Request]
}

/// One side of the matrix: a device, its PD and buffers, reused by every case.
pub struct Side {
    pub dev: Device,
    pub pd: ProtectionDomain,
    /// Receive buffer and source/target of the RDMA operations.
    pub buf: MemoryRegion,
    pub ch: CmEventChannel,
}

const BUF: usize = 1 << 14;

/// Message sizes of the data exchange.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub send: usize,
    pub write: usize,
    pub read: usize,
}

/// Several FPDUs per message (and, with markers, several markers).
pub const FULL: Sizes = Sizes {
    send: 3000,
    write: 5000,
    read: 2500,
};
/// Still more than one FPDU per message, for captures.
pub const LIGHT: Sizes = Sizes {
    send: 1500,
    write: 1000,
    read: 1000,
};

/// How to run a case.
pub struct Run<'a> {
    pub client: &'a Side,
    pub server: &'a Side,
    /// One listener for every case (its screening lets every marker setting through; the
    /// refusals the responder's own setting calls for happen at accept). `None`: a listener
    /// per case, screening with the responder's setting.
    pub listener: Option<&'a CmListener>,
    pub sizes: Sizes,
}

/// What a case put on the wire, for checking a capture of it.
#[derive(Debug, Clone, Copy)]
pub struct Wire {
    /// The initiator's TCP port.
    pub client_port: u16,
    /// CRC in use on the FPDUs (when established).
    pub crc: bool,
    /// Markers in the initiator's FPDUs (to the responder).
    pub markers_c2s: bool,
    /// Markers in the responder's FPDUs (to the initiator).
    pub markers_s2c: bool,
    /// FPDUs the initiator sent.
    pub fpdus_c2s: u64,
    /// FPDUs the responder sent.
    pub fpdus_s2c: u64,
}
/// Small FPDUs: every message spans several, and markers fall inside them.
const FPDU: usize = 600;

impl Side {
    pub fn new() -> Self {
        let dev = Device::open_default().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let buf = pd.reg_mr(BUF, access).unwrap();
        Self {
            dev,
            pd,
            buf,
            ch: CmEventChannel::new().unwrap(),
        }
    }
}

pub fn opts_for(e: &EndCfg, case: &Case, pd: &[u8]) -> ConnectOptions {
    let mut o = ConnectOptions::default()
        .revision(e.rev)
        .crc_mode(e.crc)
        .markers(e.markers)
        .private_data(pd)
        .max_fpdu_len(Some(FPDU))
        .timeout(Duration::from_secs(5));
    if let Some(kind) = case.rtr {
        o = o.peer_to_peer(true).rtr_types(RtrTypes::only(kind));
    }
    o
}

pub fn run_case(c: &Case, run: &Run<'_>) -> Wire {
    let (client, server, sizes) = (run.client, run.server, run.sizes);
    let what = format!("{c:?}");
    let scq = server.dev.create_cq(64, None).unwrap();
    let ccq = client.dev.create_cq(64, None).unwrap();
    let sqp = server.pd.create_qp(&QpInitAttr::new(&scq, &scq)).unwrap();
    let cqp = client.pd.create_qp(&QpInitAttr::new(&ccq, &ccq)).unwrap();
    // Receives before connecting: the peer may send at once.
    post_recv(&sqp, &server.buf, 0, sizes.send, 1);
    post_recv(&cqp, &client.buf, 0, sizes.send, 2);

    let cpd = pattern(pd_len(c.pd, c.init.rev), 7);
    let copts = opts_for(&c.init, c, &cpd);
    let own;
    let l = match run.listener {
        Some(l) => l,
        None => {
            own = server
                .ch
                .listen(
                    "127.0.0.1:0",
                    &ListenOptions::default().options(opts_for(&c.resp, c, &[])),
                )
                .unwrap();
            &own
        }
    };
    let cid = client.ch.connect(&cqp, l.local_addr(), &copts).unwrap();
    let expect = oracle(c);
    let mut wire = Wire {
        client_port: 0,
        crc: false,
        markers_c2s: false,
        markers_s2c: false,
        fpdus_c2s: 0,
        fpdus_s2c: 0,
    };

    if expect == Expect::Rejected && run.listener.is_none() {
        match request_error(&server.ch) {
            Error::Mpa(MpaError::MarkersRequired) => {}
            other => panic!("{what}: {other}"),
        }
        match ev_of(&client.ch, cid.conn_id()) {
            CmEvent::Rejected { private_data, .. } => assert!(private_data.is_empty(), "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(cqp.state(), QpState::Idle, "{what}");
        return wire;
    }

    let req = request(&server.ch);
    wire.client_port = req.peer_addr().port();
    if expect == Expect::Rejected {
        // The shared listener let it through; the responder's setting refuses it here.
        let r = req.accept(&sqp, &opts_for(&c.resp, c, &[]));
        assert!(
            matches!(r, Err(Error::Mpa(MpaError::MarkersRequired))),
            "{what}: {r:?}"
        );
        req.reject(&[]).unwrap();
        match ev_of(&client.ch, cid.conn_id()) {
            CmEvent::Rejected { private_data, .. } => assert!(private_data.is_empty(), "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        return wire;
    }
    assert_eq!(req.private_data(), &cpd[..], "{what}");
    assert_eq!(req.revision(), c.init.rev.value(), "{what}");
    assert_eq!(req.crc_requested(), c.init.crc != CrcMode::Off, "{what}");
    assert_eq!(
        req.markers_requested(),
        c.init.markers == MarkerMode::Request,
        "{what}"
    );
    assert_eq!(req.peer_to_peer(), c.rtr.is_some(), "{what}");
    let negotiated = c.init.rev.min(c.resp.rev);
    let spd = pattern(pd_len(c.pd, negotiated), 8);
    assert_eq!(
        req.max_reply_private_data(&opts_for(&c.resp, c, &[])),
        pd_len(PdSize::Max, negotiated),
        "{what}"
    );
    let sid = req.accept(&sqp, &opts_for(&c.resp, c, &spd)).unwrap();
    let sinfo = established(&server.ch, sid.conn_id());

    let Expect::Up {
        revision,
        crc,
        markers_tx,
        markers_rx,
        rtr,
    } = expect
    else {
        // The initiator refuses a Reply that asks it for markers.
        match ev_of(&client.ch, cid.conn_id()) {
            CmEvent::ConnectError { error, .. } => {
                assert!(
                    matches!(error, Error::Mpa(MpaError::MarkersRequired)),
                    "{what}: {error}"
                )
            }
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(cqp.state(), QpState::Idle, "{what}");
        assert_eq!(
            disconnected(&server.ch, sid.conn_id()),
            DisconnectReason::PeerClosed,
            "{what}"
        );
        return wire;
    };
    wire.crc = crc;
    wire.markers_c2s = markers_tx;
    wire.markers_s2c = markers_rx;
    let cinfo = established(&client.ch, cid.conn_id());
    for (info, role) in [(&cinfo, Role::Initiator), (&sinfo, Role::Responder)] {
        assert_eq!(info.role, role, "{what}");
        assert_eq!(info.revision, revision, "{what}");
        assert_eq!(info.crc, crc, "{what}");
        assert_eq!(info.rtr, rtr, "{what}");
    }
    assert_eq!(
        (cinfo.markers_tx, cinfo.markers_rx),
        (markers_tx, markers_rx),
        "{what}"
    );
    assert_eq!(
        (sinfo.markers_tx, sinfo.markers_rx),
        (markers_rx, markers_tx),
        "{what}"
    );
    assert_eq!(cinfo.peer_private_data, spd, "{what}");
    assert_eq!(sinfo.peer_private_data, cpd, "{what}");
    if revision == 2 {
        assert_eq!(
            cinfo.peer_ird_ord.map(|(i, _)| i as usize),
            Some(sinfo.ird),
            "{what}"
        );
        assert_eq!(
            sinfo.peer_ird_ord.map(|(_, o)| o as usize),
            Some(cinfo.ord),
            "{what}"
        );
    } else {
        assert_eq!(
            (cinfo.peer_ird_ord, sinfo.peer_ird_ord),
            (None, None),
            "{what}"
        );
    }

    exchange(c, &what, run, (&cqp, &ccq), (&sqp, &scq));

    cid.disconnect().unwrap();
    assert_eq!(
        disconnected(&client.ch, cid.conn_id()),
        DisconnectReason::Local,
        "{what}"
    );
    assert_eq!(
        disconnected(&server.ch, sid.conn_id()),
        DisconnectReason::PeerClosed,
        "{what}"
    );
    for cq in [&ccq, &scq] {
        while let Some(wc) = cq.poll_one() {
            assert_eq!(wc.status, WcStatus::WrFlushErr, "{what}");
        }
    }
    wire.fpdus_c2s = cqp.stats().tx_fpdus;
    wire.fpdus_s2c = sqp.stats().tx_fpdus;
    wire
}

/// Send each way, an RDMA Write and an RDMA Read, all over several FPDUs, bytes checked.
fn exchange(
    c: &Case,
    what: &str,
    run: &Run<'_>,
    (cqp, ccq): (&QueuePair, &CompletionQueue),
    (sqp, scq): (&QueuePair, &CompletionQueue),
) {
    let (client, server) = (run.client, run.server);
    let Sizes {
        send: send_len,
        write: write_len,
        read: read_len,
    } = run.sizes;
    let seed = (c.pd as u64) << 8 | c.rtr.map_or(0, |k| k as u64 + 1);
    let cdata = pattern(BUF, seed ^ 0xc1);
    let sdata = pattern(BUF, seed ^ 0x5e);
    // Client layout: [0, send_len) receive; [4096, ...) source of its Send and Write;
    // [12288, +read_len) Read sink. Server: [0, send_len) receive; [4096, ...) its Send
    // source; [8192, +write_len) Write target; it is also the Read source.
    let src_len = send_len.max(write_len).max(read_len);
    client.buf.write_at(4096, &cdata[..src_len]).unwrap();
    server.buf.write_at(4096, &sdata[..src_len]).unwrap();
    post_send(cqp, &client.buf, 4096, send_len, 11);
    let wc = next_wc(ccq, what);
    assert_eq!((wc.wr_id, wc.status), (11, WcStatus::Success), "{what}");
    let wc = next_wc(scq, what);
    assert_eq!(
        (wc.wr_id, wc.byte_len),
        (1, send_len as u32),
        "{what}: {wc:?}"
    );
    assert!(
        server.buf.to_vec().unwrap()[..send_len] == cdata[..send_len],
        "{what}"
    );

    post_send(sqp, &server.buf, 4096, send_len, 21);
    let wc = next_wc(scq, what);
    assert_eq!((wc.wr_id, wc.status), (21, WcStatus::Success), "{what}");
    let wc = next_wc(ccq, what);
    assert_eq!(
        (wc.wr_id, wc.byte_len),
        (2, send_len as u32),
        "{what}: {wc:?}"
    );
    assert!(
        client.buf.to_vec().unwrap()[..send_len] == sdata[..send_len],
        "{what}"
    );

    cqp.post_send(&SendWr {
        wr_id: 12,
        op: SendOp::Write {
            remote_addr: server.buf.addr() + 8192,
            rkey: server.buf.rkey(),
        },
        payload: Payload::Sgl(SgList::single(
            client.buf.sge(4096, write_len as u32).unwrap(),
        )),
        signaled: true,
        fence: false,
    })
    .unwrap();
    cqp.post_send(&SendWr {
        wr_id: 13,
        op: SendOp::Read {
            remote_addr: server.buf.addr() + 4096,
            rkey: server.buf.rkey(),
        },
        payload: Payload::Sgl(SgList::single(
            client.buf.sge(12288, read_len as u32).unwrap(),
        )),
        signaled: true,
        fence: true,
    })
    .unwrap();
    for id in [12, 13] {
        let wc = next_wc(ccq, what);
        assert_eq!(
            (wc.wr_id, wc.status),
            (id, WcStatus::Success),
            "{what}: {wc:?}"
        );
    }
    assert!(
        server.buf.to_vec().unwrap()[8192..8192 + write_len] == cdata[..write_len],
        "{what}"
    );
    assert!(
        client.buf.to_vec().unwrap()[12288..12288 + read_len] == sdata[..read_len],
        "{what}"
    );
    for qp in [cqp, sqp] {
        assert_eq!(qp.stats().crc_errors, 0, "{what}");
    }
}

fn next_wc(cq: &CompletionQueue, what: &str) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(Instant::now() < deadline, "{what}: no completion");
        std::thread::sleep(Duration::from_micros(50));
    }
}
