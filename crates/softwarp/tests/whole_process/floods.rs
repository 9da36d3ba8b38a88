//! Floods and slow peers, measured: thousands of TCP connections to a connection manager
//! listener that never finish their MPA Request (silent, stopped halfway, trickling one
//! byte at a time), and raw peers that send unsolicited Sends or Read Requests far beyond
//! the IRD in bulk. In each case the process's memory (RSS) and its Softwarp threads stay
//! within a stated bound, the RFC-prescribed Terminate is the only answer to the raw peers,
//! and a good client still connects and moves data within a bound.
//!
//! The tests measure the whole process, so they run one at a time (`serial`), in a binary of
//! their own (`whole_process`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use peer::{ulpdu, Offer, RawPeer, Role};
use softwarp::*;
use softwarp_testkit::serial;
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaRevision, RtrFlags, HEADER_LEN, MAX_PRIVATE_DATA_LEN,
};
use softwarp_wire::rdmap::{
    DdpError, Message, Placement, RdmapError, ReadRequestRepr, RemoteOperationError, Segment,
    TerminateError, UntaggedBufferError,
};

use crate::peer;
use crate::util::*;

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// Names of the threads of this process that Softwarp started (they begin with
/// `softwarp`).
fn softwarp_thread_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim_end().to_string())
        .filter(|c| c.starts_with("softwarp"))
        .collect();
    names.sort();
    names
}

/// [`softwarp_thread_names`] once threads just spawned have named themselves (a new thread
/// sets its own name, so right after the spawn it still bears its creator's).
fn settled_thread_names() -> Vec<String> {
    let mut last = softwarp_thread_names();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(50));
        let now = softwarp_thread_names();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A valid MPA revision 2 Request with 500 bytes of private data (520 bytes in all).
fn long_request() -> Vec<u8> {
    let pd = [0x42u8; 500];
    let frame = MpaFrame {
        kind: MpaFrameKind::Request,
        marker: false,
        crc: false,
        reject: false,
        revision: MpaRevision::Rev2,
        enhanced: Some(EnhancedParams {
            ird: 16,
            ord: 16,
            peer_to_peer: false,
            rtr: RtrFlags::NONE,
        }),
        private_data: &pd,
    };
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let n = frame.emit(&mut buf).unwrap();
    buf[..n].to_vec()
}

/// How a flooding connection behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// Connects and sends nothing.
    Silent,
    /// Sends the first half of a Request at once, then nothing.
    Half,
    /// Sends a Request one byte per round (it never finishes within the timeout).
    Trickle,
}

struct Flooder {
    stream: TcpStream,
    style: Style,
    sent: usize,
}

impl Flooder {
    /// Sends what its style allows this round.
    fn pump(&mut self, request: &[u8]) {
        let upto = match self.style {
            Style::Silent => 0,
            Style::Half => request.len() / 2,
            Style::Trickle => (self.sent + 1).min(request.len() - 1),
        };
        while self.sent < upto {
            match self.stream.write(&request[self.sent..upto]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Not connected yet, or closed by the listener (timed out): later, or never.
                Err(_) => return,
            }
        }
    }
}

/// The most RSS and Softwarp threads seen while sampling.
#[derive(Debug, Default, Clone)]
struct Peak {
    rss: u64,
    threads: usize,
    names: Vec<String>,
    negotiating: usize,
}

impl Peak {
    fn sample(&mut self, l: &CmListener) {
        self.rss = self.rss.max(rss());
        let names = softwarp_thread_names();
        if names.len() > self.threads {
            self.threads = names.len();
            self.names = names;
        }
        self.negotiating = self.negotiating.max(l.stats().negotiating);
    }
}

/// A good client (its own device and QP) connects through the connection manager, sends
/// 64 KiB and the server checks every byte. Returns how long it took.
fn good_client(l: &CmListener, cch: &CmEventChannel, server: &End, client: &End) -> Duration {
    const LEN: usize = 64 * 1024;
    let (sink, _) = server.mr(LEN, LW, 0);
    let (src, data) = client.mr(LEN, LW, 0x900d);
    server
        .qp
        .post_recv(&RecvWr {
            wr_id: 1,
            sgl: SgList::single(sink.sge(0, LEN as u32).unwrap()),
        })
        .unwrap();
    let opts = ConnectOptions::default().timeout(WAIT);
    let start = Instant::now();
    std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&server.qp, &opts, Some(WAIT)).unwrap());
        cch.connect_blocking(&client.qp, l.local_addr(), &opts)
            .unwrap();
        h.join().unwrap();
    });
    client
        .qp
        .post_send(&send_wr(
            1,
            send_op(false, None),
            Payload::Sgl(sgl(&src, 0, LEN, 1)),
        ))
        .unwrap();
    assert_eq!(wait_wcs(&client.scq, 1)[0].status, WcStatus::Success);
    let wc = wait_wcs(&server.rcq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    assert_eq!(wc[0].byte_len as usize, LEN);
    assert!(
        sink.to_vec().unwrap() == data,
        "the good client's bytes differ"
    );
    start.elapsed()
}

#[test]
fn thousands_of_connections_that_never_finish_mpa_are_bounded_and_a_good_client_is_served() {
    const FLOOD: usize = 2000;
    // The default backlog: the listener holds 1024 and the kernel queues up to 1024 more,
    // so every flooding SYN (and the good client's) is answered without SYN retries.
    const BACKLOG: u32 = 1024;
    // siw's wait for an MPA Request: without eviction the good client would wait for it.
    const TIMEOUT: Duration = Duration::from_secs(10);
    // Eviction lets the good client in after about EVICT_AGE (1 s); a SYN of it that the
    // kernel dropped while its queue was full is retried after 1 s and 3 s more.
    const SERVED_WITHIN: Duration = Duration::from_secs(6);
    let _serial = serial();
    if !raise_nofile(3 * FLOOD as u64 + 1024) {
        let limit = 3 * FLOOD + 1024;
        softwarp_testkit::skip(format!("the hard limit on open files is below {limit}"));
        return;
    }
    opt_in_ras();
    let ch = CmEventChannel::new().unwrap();
    let l = ch
        .listen(
            "127.0.0.1:0",
            &ListenOptions::default().options(ConnectOptions::default().timeout(TIMEOUT)),
        )
        .unwrap();
    // Everything a good client needs exists before the baseline: the flood is what is
    // measured.
    let server = End::new(None, None);
    let client = End::new(None, None);
    let cch = CmEventChannel::new().unwrap();
    let names0 = settled_thread_names();
    let (rss0, fds0) = (rss(), open_fds());
    let threads0 = names0.len();

    let request = long_request();
    let addr: SocketAddr = l.local_addr();
    let mut flood: Vec<Flooder> = (0..FLOOD)
        .map(|i| Flooder {
            stream: TcpStream::connect(addr).unwrap(),
            style: match i % 4 {
                0 | 1 => Style::Silent,
                2 => Style::Half,
                _ => Style::Trickle,
            },
            sent: 0,
        })
        .collect();
    let mut peak = Peak::default();
    let pump = |flood: &mut Vec<Flooder>, peak: &mut Peak, d: Duration| {
        let end = Instant::now() + d;
        while Instant::now() < end {
            for f in flood.iter_mut() {
                f.pump(&request);
            }
            peak.sample(&l);
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    pump(&mut flood, &mut peak, Duration::from_millis(500));
    let s = l.stats();
    assert_eq!(s.backlog, BACKLOG as usize);
    assert_eq!(
        s.negotiating, BACKLOG as usize,
        "the listener is full of connections that never finish: {s:?}"
    );

    // A good client arrives in the middle of the flood; the flood goes on meanwhile.
    let took = std::thread::scope(|sc| {
        let h = sc.spawn(|| good_client(&l, &cch, &server, &client));
        let mut flood = std::mem::take(&mut flood);
        while !h.is_finished() {
            pump(&mut flood, &mut peak, Duration::from_millis(100));
        }
        (h.join().unwrap(), flood)
    });
    let (took, mut flood) = took;
    pump(&mut flood, &mut peak, Duration::from_millis(500));
    let s = l.stats();
    eprintln!(
        "{FLOOD} flooding connections, backlog {BACKLOG}, timeout {TIMEOUT:?}: good client \
         served in {took:?}; RSS {} KiB -> peak {} KiB; Softwarp threads {threads0} -> peak \
         {}; peak negotiating {}; {s:?}",
        rss0 / 1024,
        peak.rss / 1024,
        peak.threads,
        peak.negotiating
    );
    assert!(peak.negotiating <= BACKLOG as usize);
    assert!(
        peak.threads <= threads0,
        "threads grew: {names0:?} -> {:?}",
        peak.names
    );
    // The listener holds at most BACKLOG connections, each a socket, a 532-byte frame
    // buffer and its job; 4 KiB each is generous, 16 MiB covers the allocator and the
    // good client's 64 KiB buffers.
    let bound = u64::from(BACKLOG) * 4096 + (16 << 20);
    assert!(
        peak.rss.saturating_sub(rss0) <= bound,
        "RSS grew by {} KiB (bound {} KiB)",
        peak.rss.saturating_sub(rss0) / 1024,
        bound / 1024
    );
    assert!(took <= SERVED_WITHIN, "the good client waited {took:?}");
    assert!(s.evicted > 0, "{s:?}");
    let id = l.id().to_string();
    let local = l.local_addr().to_string();
    assert_eq!(
        softwarp_ras::stats::collect_all().get(
            "softwarp_cm_listener_evicted_total",
            &[("listener", id.as_str()), ("local", local.as_str())]
        ),
        Some(softwarp_ras::stats::Value::Int(s.evicted))
    );

    // The flood ends: the listener lets go of everything, the descriptors come back.
    drop(flood);
    let deadline = Instant::now() + WAIT;
    while l.stats().negotiating > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(l.stats().negotiating, 0, "{:?}", l.stats());
    assert!(
        open_fds() <= fds0 + 8,
        "descriptors left: {} (baseline {fds0})",
        open_fds()
    );
    drop((server, client, cch));
}

/// The error a Terminate ULPDU carries.
fn terminate_error(ulpdu: &[u8]) -> TerminateError {
    match Segment::parse(ulpdu).unwrap().message {
        Message::Terminate(repr) => repr.error,
        other => panic!("not a Terminate: {other:?}"),
    }
}

/// Bytes of a burst from a raw peer: `n` FPDUs made by `fpdu(i)`.
fn burst(n: u32, fpdu: impl Fn(u32) -> Vec<u8>) -> Vec<u8> {
    (1..=n).flat_map(fpdu).collect()
}

/// What the stack's process holds before and after a burst.
struct Footprint {
    rss: u64,
    threads: Vec<String>,
    fds: usize,
}

impl Footprint {
    fn now() -> Self {
        Self {
            threads: settled_thread_names(),
            rss: rss(),
            fds: open_fds(),
        }
    }

    /// RSS grew by at most `bytes`, and no thread or descriptor was added.
    fn assert_within(&self, later: &Footprint, bytes: u64, what: &str) {
        let grew = later.rss.saturating_sub(self.rss);
        eprintln!(
            "{what}: RSS {} KiB -> {} KiB (+{} KiB, bound {} KiB), threads {} -> {}, \
             descriptors {} -> {}",
            self.rss / 1024,
            later.rss / 1024,
            grew / 1024,
            bytes / 1024,
            self.threads.len(),
            later.threads.len(),
            self.fds,
            later.fds
        );
        assert!(grew <= bytes, "{what}: RSS grew by {grew} bytes");
        assert!(
            later.threads.len() <= self.threads.len(),
            "{what}: threads {:?} -> {:?}",
            self.threads,
            later.threads
        );
        assert!(
            later.fds <= self.fds,
            "{what}: descriptors {} -> {}",
            self.fds,
            later.fds
        );
    }
}

/// A burst of 10,000 Sends of 1 KiB (10 MiB) to a QP with no receive posted: the first gets
/// DDP's "no buffer available" Terminate, nothing else is answered, placed or completed,
/// and the stack's memory does not take the burst in.
#[test]
fn a_burst_of_unsolicited_sends_gets_one_terminate_and_nothing_grows() {
    const SENDS: u32 = 10_000;
    let _serial = serial();
    let stack = End::new(None, None);
    // No RNR wait: the first Send fails the stream at once.
    let (mut peer, _) = RawPeer::connect(
        Role::Initiator,
        &stack.qp,
        &ConnectOptions::default().rnr_wait(None),
        Offer::default(),
    );
    let payload = [0x5au8; 1024];
    let bytes = burst(SENDS, |msn| {
        peer.frame(&ulpdu(&Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::Send,
            payload: &payload,
        }))
    });
    let before = Footprint::now();
    let sent = peer.send_burst(&bytes);
    let (answers, t) = peer.read_until_terminate(0);
    assert!(answers.is_empty());
    //= https://www.rfc-editor.org/rfc/rfc5041#section-7.2
    // (paraphrase) An untagged segment with no buffer to place it in is an Untagged Buffer
    // Error, "Invalid MSN - no buffer available" (code 1).
    assert_eq!(
        terminate_error(&t.ulpdu),
        TerminateError::Ddp(DdpError::UntaggedBuffer(
            UntaggedBufferError::InvalidMsnNoBuffer
        ))
    );
    peer.expect_close_or_reset();
    wait_state(&stack.qp, QpState::Error);
    let st = stack.qp.stats();
    assert_eq!(st.terminates_sent, 1, "{st:?}");
    assert_eq!(st.rx.send.messages, 0, "nothing delivered: {st:?}");
    assert_no_wc(&stack.rcq, Duration::from_millis(50));
    let after = Footprint::now();
    eprintln!(
        "{SENDS} unsolicited Sends ({} KiB offered, {} KiB taken by the kernel), {} FPDUs read \
         by the stack",
        bytes.len() / 1024,
        sent / 1024,
        st.rx_fpdus
    );
    before.assert_within(&after, 4 << 20, "unsolicited Sends");
    drop(peer);
}

/// 10,000 RDMA Read Requests of 64 KiB each (625 MiB asked for) in one burst to a QP whose
/// IRD is 2: at most the first 2 are answered, the third gets the Terminate for an exceeded
/// IRD, nothing else is answered, and no response is queued for the rest.
#[test]
fn read_requests_far_beyond_the_ird_get_one_terminate_and_nothing_grows() {
    const IRD: usize = 2;
    const REQUESTS: u32 = 10_000;
    const SIZE: u32 = 64 << 10;
    let _serial = serial();
    let stack = End::with(None, None, |a| a.max_dest_rd_atomic = IRD);
    let source = stack
        .pd
        .reg_mr(SIZE as usize, LW | AccessFlags::REMOTE_READ)
        .unwrap();
    let (mut peer, info) = RawPeer::connect(
        Role::Responder,
        &stack.qp,
        &ConnectOptions::default(),
        Offer {
            ord: IRD as u16,
            ..Offer::default()
        },
    );
    assert_eq!(info.ird, IRD);
    let bytes = burst(REQUESTS, |msn| {
        peer.frame(&ulpdu(&Segment {
            last: true,
            placement: Placement::Untagged { msn, mo: 0 },
            message: Message::RdmaReadRequest(ReadRequestRepr {
                sink_stag: 0x0012_3400,
                sink_tagged_offset: 0x7000_0000,
                read_size: SIZE,
                source_stag: source.rkey().0,
                source_tagged_offset: source.addr(),
            }),
            payload: &[],
        }))
    });
    let before = Footprint::now();
    let sent = peer.send_burst(&bytes);
    let (responses, t) = peer.read_until_terminate(4096);
    let answered: usize = responses
        .iter()
        .map(|r| {
            let seg = Segment::parse(&r.ulpdu).unwrap();
            assert_eq!(seg.message, Message::RdmaReadResponse);
            seg.payload.len()
        })
        .sum();
    assert!(
        answered <= IRD * SIZE as usize,
        "{answered} bytes answered: more than {IRD} Reads"
    );
    //= https://www.rfc-editor.org/rfc/rfc5040#section-5.2
    // (paraphrase) A Data Source accepts at most IRD outstanding RDMA Read Requests (the
    // Terminate the engine sends for one more is explained in raw_peer.rs).
    assert_eq!(
        terminate_error(&t.ulpdu),
        TerminateError::Rdmap(RdmapError::RemoteOperation(
            RemoteOperationError::CatastrophicLocalToStream
        ))
    );
    peer.expect_close_or_reset();
    wait_state(&stack.qp, QpState::Error);
    let st = stack.qp.stats();
    assert_eq!(st.terminates_sent, 1, "{st:?}");
    assert!(st.tx.read_response.messages <= IRD as u64, "{st:?}");
    let after = Footprint::now();
    eprintln!(
        "{REQUESTS} Read Requests of {SIZE} bytes beyond IRD {IRD} ({} KiB offered, {} KiB \
         taken by the kernel): {answered} bytes answered before the Terminate",
        bytes.len() / 1024,
        sent / 1024
    );
    before.assert_within(&after, 4 << 20, "Read Requests beyond the IRD");
    drop(source);
    drop(peer);
}
