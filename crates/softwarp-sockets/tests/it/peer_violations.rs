//! A hostile peer against an iWARP stream: a raw peer built on softwarp's verbs speaks the
//! stream protocol by hand (hello, 8-byte headers, credits kept exactly as `credits.rs`
//! says) and sends what the protocol forbids: WROTE notices with no window exposed or
//! outside the windows, more notices than the program takes, grants of slots it never got,
//! empty GRANT and DATA messages, DATA after its EOF, a second EOF, empty or too many
//! windows. Each aborts the stream at once: its calls return `ConnectionAborted` with the
//! `PeerViolation`, the queue the messages would have grown stays within its bound, the
//! kind's counter goes up, the error log gets a `peer_violation` line for the stream's QP,
//! and the peer's QP is terminated.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use softwarp::{
    AccessFlags, CompletionQueue, ConnectOptions, Device, MemoryRegion, Payload, QpCap, QpInitAttr,
    QueuePair, RecvWr, SendOp, SendWr, SgList, WcStatus, EMPTY_COMPLETION,
};
use softwarp_sockets::credits::Credits;
use softwarp_sockets::violation::{MAX_NOTICES_UNREAD, MAX_NOTICES_UNSENT};
use softwarp_sockets::wire::{encode_wrote, Header, Hello, Kind, WindowAd, HEADER_LEN};
use softwarp_sockets::{IwarpListener, IwarpStream, PeerViolation};

const WAIT: Duration = Duration::from_secs(10);
const SLOTS: u32 = 16;
const SLOT_SIZE: usize = 4096;

/// The process's error log, in a directory of this test binary's own.
fn error_log() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("peer_violations-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = softwarp_ras::errlog::ErrorLogConfig::in_dir(&dir);
        let path = config.path.clone();
        let log = softwarp_ras::errlog::ErrorLog::open(config).unwrap();
        assert!(
            softwarp_ras::errlog::set_global(log),
            "an error log was set"
        );
        path
    })
}

/// The exported count of violations of kind `name` (the RAS statistics).
fn exported(name: &str) -> u64 {
    let snap = softwarp_ras::stats::collect_all();
    match snap.get(
        "softwarp_sockets_peer_violations_total",
        &[("violation", name)],
    ) {
        Some(v) => v.as_f64() as u64,
        None => 0,
    }
}

/// The far end, speaking the stream protocol by hand over its own device.
struct RawPeer {
    qp: QueuePair,
    rx: MemoryRegion,
    tx: MemoryRegion,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    credits: Credits,
    free_tx: Vec<u32>,
    /// Windows the stream advertised.
    windows: Vec<WindowAd>,
    /// WROTE notices received.
    notices: usize,
    /// The connection failed (a receive or send completed with an error).
    closed: bool,
    pd: softwarp::ProtectionDomain,
    _dev: Device,
}

impl RawPeer {
    /// Connects to `listener` (accepted on a thread) as the initiator; returns the peer and
    /// the stream the listener accepted.
    fn connect(listener: IwarpListener) -> (RawPeer, IwarpStream) {
        let addr = listener.local_addr().unwrap();
        let accepted = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
        let dev = Device::builder().open().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let send_cq = dev.create_cq(SLOTS as usize, None).unwrap();
        let recv_cq = dev.create_cq(SLOTS as usize, None).unwrap();
        let mut attr = QpInitAttr::new(&send_cq, &recv_cq);
        attr.cap = QpCap {
            max_send_wr: SLOTS as usize,
            max_recv_wr: SLOTS as usize,
            ..QpCap::default()
        };
        let qp = pd.create_qp(&attr).unwrap();
        let len = SLOT_SIZE * SLOTS as usize;
        let rx = pd.reg_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
        let tx = pd.reg_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
        for slot in 0..SLOTS {
            post_slot(&qp, &rx, slot);
        }
        let hello = Hello {
            slots: SLOTS,
            slot_size: SLOT_SIZE as u32,
        };
        let opts = ConnectOptions::default()
            .peer_to_peer(true)
            .first_fpdu_delay(Duration::ZERO)
            .timeout(WAIT)
            .private_data(&hello.encode());
        let tcp = std::net::TcpStream::connect(addr).unwrap();
        tcp.set_nodelay(true).unwrap();
        let info = qp.connect_stream(tcp, &opts).unwrap();
        let theirs = Hello::decode(&info.peer_private_data).unwrap();
        let stream = accepted.join().unwrap().unwrap();
        let peer = RawPeer {
            qp,
            rx,
            tx,
            send_cq,
            recv_cq,
            credits: Credits::new(SLOTS, theirs.slots),
            free_tx: (0..SLOTS).collect(),
            windows: Vec::new(),
            notices: 0,
            closed: false,
            pd,
            _dev: dev,
        };
        (peer, stream)
    }

    /// Takes the stream's messages (grants, windows) and the send completions.
    fn pump(&mut self) {
        let mut wcs = [EMPTY_COMPLETION; 16];
        let n = self.send_cq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                self.closed = true;
            }
            self.free_tx.push(wc.wr_id as u32);
        }
        let n = self.recv_cq.poll(&mut wcs).unwrap();
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                self.closed = true;
                continue;
            }
            let slot = wc.wr_id as u32;
            let mut msg = vec![0u8; wc.byte_len as usize];
            self.rx
                .read_at(slot as usize * SLOT_SIZE, &mut msg)
                .unwrap();
            let (h, body) = Header::decode(&msg).unwrap();
            self.credits.on_receive(u32::from(h.grant)).unwrap();
            match h.kind {
                Kind::Window => self.windows.push(WindowAd::decode(body).unwrap()),
                Kind::Wrote => self.notices += 1,
                _ => {}
            }
            post_slot(&self.qp, &self.rx, slot);
            self.credits.on_repost();
        }
    }

    /// Sends one message as soon as credits allow (the stream makes progress meanwhile),
    /// with `grant` in its header instead of the slots due when given. False when the
    /// stream failed first.
    fn send(&mut self, s: &IwarpStream, kind: Kind, grant: Option<u16>, body: &[u8]) -> bool {
        let deadline = Instant::now() + WAIT;
        loop {
            if s.poll_ready().error {
                return false;
            }
            self.pump();
            assert!(!self.closed, "the raw peer's connection failed first");
            if self.credits.can_send_message() && !self.free_tx.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "no credit within {WAIT:?}");
            std::thread::sleep(Duration::from_micros(200));
        }
        let due = self.credits.take_message().unwrap();
        self.post(kind, grant.unwrap_or(u16::try_from(due).unwrap()), body);
        true
    }

    /// Returns the slots the stream filled when the grant rule says so (`credits.rs`).
    fn grant_back(&mut self) {
        if self.free_tx.is_empty() {
            return;
        }
        if let Some(g) = self.credits.take_grant_message() {
            self.post(Kind::Grant, u16::try_from(g).unwrap(), &[]);
        }
    }

    /// Posts one message from a free send slot (credits taken by the caller).
    fn post(&mut self, kind: Kind, grant: u16, body: &[u8]) {
        let slot = self.free_tx.pop().unwrap();
        let header = Header { kind, grant };
        let base = slot as usize * SLOT_SIZE;
        self.tx.write_at(base, &header.encode()).unwrap();
        self.tx.write_at(base + HEADER_LEN, body).unwrap();
        let sge = self.tx.sge(base, (HEADER_LEN + body.len()) as u32).unwrap();
        self.qp
            .post_send(&SendWr {
                wr_id: u64::from(slot),
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                payload: Payload::Sgl(SgList::single(sge)),
                signaled: true,
                fence: false,
            })
            .unwrap();
    }

    /// Registers `len` bytes the stream may write and advertises them at `offset`.
    fn expose(&mut self, s: &IwarpStream, len: usize, offset: u64) -> MemoryRegion {
        let mr = self
            .pd
            .reg_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
        let ad = WindowAd {
            offset,
            addr: mr.addr(),
            stag: mr.rkey().0,
            len: len as u64,
        };
        assert!(self.send(s, Kind::Window, None, &ad.encode()));
        mr
    }

    /// Waits until the stream advertised `n` windows.
    fn wait_windows(&mut self, s: &IwarpStream, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.windows.len() < n {
            s.poll_ready();
            self.pump();
            assert!(Instant::now() < deadline, "no WINDOW within {WAIT:?}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Waits until this peer's connection was terminated by the stream's end.
    fn wait_terminated(&mut self, s: &IwarpStream) {
        let deadline = Instant::now() + WAIT;
        while self.qp.error_reason().is_none() {
            s.poll_ready();
            self.pump();
            assert!(
                Instant::now() < deadline,
                "the raw peer's QP is still {:?} after {WAIT:?}",
                self.qp.state()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn post_slot(qp: &QueuePair, rx: &MemoryRegion, slot: u32) {
    qp.post_recv(&RecvWr {
        wr_id: u64::from(slot),
        sgl: SgList::single(rx.sge(slot as usize * SLOT_SIZE, SLOT_SIZE as u32).unwrap()),
    })
    .unwrap();
}

fn pair() -> (RawPeer, IwarpStream) {
    RawPeer::connect(IwarpListener::bind_iwarp("127.0.0.1:0").unwrap())
}

/// The stream's error: `ConnectionAborted` carrying the peer's violation.
fn violation_of(e: &std::io::Error) -> PeerViolation {
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionAborted, "{e}");
    e.get_ref()
        .and_then(|i| i.downcast_ref::<PeerViolation>())
        .unwrap_or_else(|| panic!("not a peer violation: {e:?}"))
        .clone()
}

/// What every violation leaves: a read and a write fail with it, no WROTE notice is handed
/// out past those queued before, the error log has its line, the counter moved, the peer
/// was terminated.
fn check_aborted(peer: &mut RawPeer, mut s: IwarpStream, want: &str, counted_before: u64) {
    let err = s.read(&mut [0u8; 16]).unwrap_err();
    let v = violation_of(&err);
    assert_eq!(v.name(), want, "{v}");
    let err = std::io::Write::write(&mut s, b"x").unwrap_err();
    assert_eq!(violation_of(&err), v);
    assert!(
        exported(want) > counted_before,
        "softwarp_sockets_peer_violations_total{{violation=\"{want}\"}} did not move"
    );
    assert!(softwarp_sockets::peer_violations() > 0);
    peer.wait_terminated(&s);
    let qpn = s.qp_num().unwrap();
    let lines = std::fs::read_to_string(error_log()).unwrap_or_default();
    let line = lines
        .lines()
        .find(|l| l.contains("\"peer_violation\"") && l.contains(&format!("\"qpn\":{qpn},")))
        .unwrap_or_else(|| panic!("no peer_violation line for QP {qpn} in:\n{lines}"));
    assert!(line.contains(&v.to_string()), "{line}");
}

#[test]
fn a_flood_of_wrote_notices_without_a_window_aborts_at_the_first() {
    error_log();
    let before = exported("wrote_without_window");
    let (mut peer, s) = pair();
    let mut sent = 0;
    while sent < 4 * MAX_NOTICES_UNREAD && peer.send(&s, Kind::Wrote, None, &encode_wrote(0, 64)) {
        sent += 1;
    }
    // Only the notices already in flight when the first arrived got through the credits.
    eprintln!("no window: {sent} notices sent before the stream failed");
    assert!(
        sent <= SLOTS as usize,
        "{sent} notices sent before the stream failed"
    );
    assert!(
        s.recv_write_notice(Duration::ZERO).is_err(),
        "a notice was queued"
    );
    check_aborted(&mut peer, s, "wrote_without_window", before);
}

#[test]
fn a_wrote_notice_outside_the_exposed_windows_aborts_the_stream() {
    error_log();
    let before = exported("wrote_outside_window");
    let (mut peer, s) = pair();
    let w = s.expose(4096, 1 << 20).unwrap();
    peer.wait_windows(&s, 1);
    // Inside (its last byte included): handed to the program.
    assert!(peer.send(&s, Kind::Wrote, None, &encode_wrote((1 << 20) + 4000, 96)));
    assert_eq!(s.recv_write_notice(WAIT).unwrap(), ((1 << 20) + 4000, 96));
    // One byte past its end.
    assert!(peer.send(&s, Kind::Wrote, None, &encode_wrote((1 << 20) + 4000, 97)));
    let mut sent = 0;
    while sent < 4 * MAX_NOTICES_UNREAD && peer.send(&s, Kind::Wrote, None, &encode_wrote(0, 1)) {
        sent += 1;
    }
    assert!(
        sent <= SLOTS as usize,
        "{sent} notices sent after the bad one"
    );
    assert!(s.recv_write_notice(Duration::ZERO).is_err());
    drop(w);
    check_aborted(&mut peer, s, "wrote_outside_window", before);
}

#[test]
fn wrote_notices_the_program_does_not_take_are_bounded() {
    error_log();
    let before = exported("too_many_notices");
    let (mut peer, s) = pair();
    let _w = s.expose(4096, 0).unwrap();
    peer.wait_windows(&s, 1);
    let mut sent = 0;
    while sent < 4 * MAX_NOTICES_UNREAD && peer.send(&s, Kind::Wrote, None, &encode_wrote(0, 4096))
    {
        sent += 1;
    }
    assert!(
        sent < MAX_NOTICES_UNREAD + SLOTS as usize,
        "{sent} notices sent and the stream goes on"
    );
    // Exactly the bound was kept, in order, and then the stream's error.
    let mut kept = 0;
    loop {
        match s.recv_write_notice(Duration::ZERO) {
            Ok(n) => {
                assert_eq!(n, (0, 4096));
                kept += 1;
            }
            Err(e) => {
                assert_eq!(violation_of(&e), PeerViolation::TooManyNotices);
                break;
            }
        }
        assert!(
            kept <= MAX_NOTICES_UNREAD,
            "more notices kept than the bound"
        );
    }
    assert_eq!(kept, MAX_NOTICES_UNREAD);
    eprintln!("unread notices: {sent} sent, {kept} kept");
    check_aborted(&mut peer, s, "too_many_notices", before);
}

fn window(offset: u64, len: u64) -> Vec<u8> {
    WindowAd {
        offset,
        addr: 0x1000,
        stag: 0x100,
        len,
    }
    .encode()
    .to_vec()
}

const DATA: &[u8] = b"bytes";

/// Sends `messages` (`(kind, grant in the header instead of the slots due, body)`), all
/// allowed but the last, and checks that the last aborted the stream with violation `name`.
fn forbidden(name: &str, messages: Vec<(Kind, Option<u16>, Vec<u8>)>) {
    error_log();
    let before = exported(name);
    let (mut peer, mut s) = pair();
    let last = messages.len() - 1;
    for (i, (kind, grant, body)) in messages.into_iter().enumerate() {
        assert!(
            peer.send(&s, kind, grant, &body),
            "the stream failed at message {i} of {}",
            last + 1
        );
        if i < last {
            // Everything before the last message is allowed.
            let deadline = Instant::now() + Duration::from_millis(100);
            while Instant::now() < deadline {
                assert!(!s.poll_ready().error, "message {i} refused");
                peer.pump();
            }
            if kind == Kind::Data {
                let mut buf = [0u8; 64];
                assert_eq!(s.read(&mut buf).unwrap(), DATA.len());
            }
        }
    }
    let deadline = Instant::now() + WAIT;
    while !s.poll_ready().error {
        assert!(Instant::now() < deadline, "the stream goes on");
        peer.pump();
        std::thread::sleep(Duration::from_millis(1));
    }
    check_aborted(&mut peer, s, name, before);
}

#[test]
fn a_grant_of_slots_this_end_never_filled_aborts_the_stream() {
    forbidden("overgrant", vec![(Kind::Data, Some(1), DATA.to_vec())]);
}

#[test]
fn a_grant_message_returning_nothing_aborts_the_stream() {
    forbidden("empty_grant", vec![(Kind::Grant, Some(0), Vec::new())]);
}

#[test]
fn an_empty_data_message_aborts_the_stream() {
    forbidden(
        "empty_data",
        vec![
            (Kind::Data, None, DATA.to_vec()),
            (Kind::Data, None, Vec::new()),
        ],
    );
}

#[test]
fn data_after_the_peers_eof_aborts_the_stream() {
    forbidden(
        "data_after_eof",
        vec![
            (Kind::Eof, None, Vec::new()),
            (Kind::Data, None, DATA.to_vec()),
        ],
    );
}

#[test]
fn a_second_eof_aborts_the_stream() {
    forbidden(
        "second_eof",
        vec![(Kind::Eof, None, Vec::new()), (Kind::Eof, None, Vec::new())],
    );
}

#[test]
fn an_empty_window_aborts_the_stream() {
    forbidden("empty_window", vec![(Kind::Window, None, window(0, 0))]);
}

#[test]
fn a_window_past_the_most_an_end_may_expose_aborts_the_stream() {
    let mut messages: Vec<_> = (0..17u64)
        .map(|i| (Kind::Window, None, window(i * 4096, 4096)))
        .collect();
    // The same offset again replaces a window: not one more.
    messages.insert(3, (Kind::Window, None, window(0, 8192)));
    forbidden("too_many_windows", messages);
}

/// The other way round: this end's notices wait for the peer's credits in a bounded queue.
/// A peer that takes them but returns no credit stops `write_remote_notify` (it times out)
/// instead of growing this end's memory.
#[test]
fn notices_to_a_peer_that_returns_no_credit_wait_in_a_bounded_queue() {
    let (mut peer, s) = pair();
    let _w = peer.expose(&s, 4096, 0);
    s.wait_peer_window(0, 4096, WAIT).unwrap();
    // From now on the peer neither grants nor looks at its completions.
    let started = Instant::now();
    let mut written = 0;
    let err = loop {
        match s.write_remote_notify(0, b"notice") {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        assert!(
            written <= SLOTS as usize + MAX_NOTICES_UNSENT,
            "{written} notices taken while the peer returned no credit"
        );
    };
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    // The credits the peer gave (less the one kept for grants) carried notices; the rest
    // wait, up to the bound.
    assert_eq!(written, SLOTS as usize - 1 + MAX_NOTICES_UNSENT);
    assert!(started.elapsed() < 2 * WAIT);
    assert!(!s.poll_ready().error, "the stream is still up");
    // Once the peer returns its slots, every notice taken reaches it.
    let deadline = Instant::now() + WAIT;
    while peer.notices < written {
        assert!(
            Instant::now() < deadline,
            "{} of {written} notices arrived",
            peer.notices
        );
        s.poll_ready();
        peer.pump();
        peer.grant_back();
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(peer.notices, written);
    s.write_remote_notify(0, b"again").unwrap();
}
