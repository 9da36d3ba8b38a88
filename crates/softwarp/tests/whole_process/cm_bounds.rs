//! The connection manager's bounds under a flood of raw TCP peers on loopback: a listener
//! holds at most `backlog` connections (negotiating plus unanswered requests) and leaves
//! the rest in the kernel's accept queue; the channel keeps at most
//! `MAX_QUEUED_REQUEST_ERRORS` request errors and counts what it sheds; the process's file
//! descriptors stay bounded; a good client is served once the flood is answered.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::util::*;
use mio::net::TcpStream;
use softwarp::*;
use softwarp_ras::stats::Value;
use softwarp_testkit::serial;
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaRevision, RtrFlags, HEADER_LEN, MAX_PRIVATE_DATA_LEN,
};

const BACKLOG: u32 = 4;

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A valid MPA revision 2 Request.
fn mpa_request() -> Vec<u8> {
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
        private_data: b"flood",
    };
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let n = frame.emit(&mut buf).unwrap();
    buf[..n].to_vec()
}

/// A raw TCP peer (non-blocking connect) that sends `bytes` once connected.
struct RawPeer {
    stream: TcpStream,
    bytes: Vec<u8>,
    sent: usize,
}

impl RawPeer {
    fn new(addr: SocketAddr, bytes: Vec<u8>) -> Self {
        Self {
            stream: TcpStream::connect(addr).unwrap(),
            bytes,
            sent: 0,
        }
    }

    /// Sends what it can; the connection may still be in the kernel's queues.
    fn pump(&mut self) {
        while self.sent < self.bytes.len() {
            match self.stream.write(&self.bytes[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::NotConnected | ErrorKind::Interrupted
                    ) =>
                {
                    return
                }
                // Closed by the listener (garbage refused): done.
                Err(_) => self.sent = self.bytes.len(),
            }
        }
    }
}

/// Pumps `peers` for `period`, checking the bounds every few milliseconds; returns the
/// most server-side descriptors seen (all open minus `baseline` minus the peers' own).
fn flood(
    ch: &CmEventChannel,
    l: &CmListener,
    peers: &mut [RawPeer],
    baseline: usize,
    period: Duration,
) -> usize {
    let backlog = l.stats().backlog;
    let start = Instant::now();
    let mut most = 0;
    for _ in 0..10_000 {
        for p in peers.iter_mut() {
            p.pump();
        }
        let s = l.stats();
        assert!(
            s.negotiating + s.unanswered <= backlog,
            "listener holds more than its backlog: {s:?}"
        );
        let bound = backlog + MAX_QUEUED_REQUEST_ERRORS;
        assert!(
            ch.pending_events() <= bound,
            "{} events",
            ch.pending_events()
        );
        let server_fds = open_fds().saturating_sub(baseline + peers.len());
        most = most.max(server_fds);
        assert!(
            server_fds <= backlog + 8,
            "{server_fds} descriptors beyond the peers' ({s:?})"
        );
        if start.elapsed() >= period {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    most
}

/// Reads every event, answering (dropping: a reject) each request, until the listener
/// holds nothing and nothing arrived for a while.
fn drain(ch: &CmEventChannel, l: &CmListener) -> (u64, u64) {
    let (mut requests, mut errors) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < WAIT {
        match ch.get_event(Some(Duration::from_millis(300))) {
            Ok(CmEvent::ConnectRequest(_)) => requests += 1,
            Ok(CmEvent::RequestError { .. }) => errors += 1,
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => {
                let s = l.stats();
                if s.negotiating == 0 && s.unanswered == 0 {
                    return (requests, errors);
                }
            }
        }
    }
    panic!("the listener still holds connections: {:?}", l.stats());
}

/// A client with a QP connects through the connection manager and is accepted.
fn good_client_is_served(l: &CmListener) {
    let server = End::new(None, None);
    let client = End::new(None, None);
    let cch = CmEventChannel::new().unwrap();
    let addr = l.local_addr();
    let (id, info) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&server.qp, &ConnectOptions::default(), Some(WAIT)));
        let c = cch
            .connect_blocking(&client.qp, addr, &ConnectOptions::default())
            .unwrap();
        (h.join().unwrap().unwrap(), c)
    });
    assert_eq!(info.1.role, Role::Initiator);
    assert_eq!(id.1.role, Role::Responder);
}

#[test]
fn a_flood_of_raw_peers_is_held_to_the_backlog_and_a_good_client_is_served_after() {
    let _serial = serial();
    opt_in_ras();
    let ch = CmEventChannel::new().unwrap();
    let l = ch
        .listen("127.0.0.1:0", &ListenOptions::default().backlog(BACKLOG))
        .unwrap();
    let baseline = open_fds();
    // 400 peers: even ones send a valid MPA Request, odd ones garbage (refused at once).
    let request = mpa_request();
    let mut peers: Vec<RawPeer> = (0..400)
        .map(|i| {
            let bytes = if i % 2 == 0 {
                request.clone()
            } else {
                b"GET / HTTP/1.0\r\nHost: x\r\n\r\n".to_vec()
            };
            RawPeer::new(l.local_addr(), bytes)
        })
        .collect();
    let most = flood(&ch, &l, &mut peers, baseline, Duration::from_secs(2));
    let s = l.stats();
    eprintln!(
        "400 peers, backlog {BACKLOG}: at most {most} server-side descriptors, {} events \
         queued, stats {s:?}",
        ch.pending_events()
    );
    // The application answered nothing: the listener is full of requests, and stopped.
    assert_eq!(s.unanswered, BACKLOG as usize, "{s:?}");
    assert_eq!(s.requests, u64::from(BACKLOG), "{s:?}");
    assert!(s.backlog_full >= 1, "{s:?}");
    assert!(s.accepted < 400, "it stopped accepting: {s:?}");

    // The flood ends: the peers close, the application answers everything.
    drop(peers);
    let (requests, _) = drain(&ch, &l);
    assert!(requests >= u64::from(BACKLOG));
    good_client_is_served(&l);
    let s = l.stats();
    assert_eq!((s.negotiating, s.unanswered), (0, 0), "{s:?}");
    // The good client's two devices may still linger (their QPs wait up to 2 s for the
    // peer's FIN): per device an epoll, two eventfds, a TCP socket and, with the RAS
    // services on, the rtnetlink socket of its network watch.
    assert!(
        open_fds() <= baseline + 10,
        "descriptors left: {} (baseline {baseline})",
        open_fds()
    );
}

#[test]
fn request_errors_beyond_the_queue_bound_are_shed_and_counted() {
    let _serial = serial();
    opt_in_ras();
    let ch = CmEventChannel::new().unwrap();
    // A backlog large enough for the kernel to queue every peer at once (a small one makes
    // the dropped SYNs retry for seconds): here the channel's bound is the one tested.
    let l = ch
        .listen("127.0.0.1:0", &ListenOptions::default().backlog(512))
        .unwrap();
    let baseline = open_fds();
    let garbage = 300;
    let mut peers: Vec<RawPeer> = (0..garbage)
        .map(|_| RawPeer::new(l.local_addr(), vec![0xa5; HEADER_LEN]))
        .collect();
    // Nobody reads the channel while every garbage connection is accepted and refused.
    let start = Instant::now();
    while l.stats().refused < garbage && start.elapsed() < WAIT {
        flood(&ch, &l, &mut peers, baseline, Duration::from_millis(50));
    }
    let s = l.stats();
    assert_eq!(s.refused, garbage, "{s:?}");
    assert_eq!(ch.pending_events(), MAX_QUEUED_REQUEST_ERRORS);
    let shed = garbage - MAX_QUEUED_REQUEST_ERRORS as u64;
    assert_eq!(ch.events_shed(), shed);

    // The same numbers in the process's statistics (`softwarp stat`, metrics endpoint).
    let stats = softwarp_ras::stats::collect_all();
    let id = l.id().to_string();
    let local = l.local_addr().to_string();
    let labels = [("listener", id.as_str()), ("local", local.as_str())];
    assert_eq!(
        stats.get("softwarp_cm_listener_refused_total", &labels),
        Some(Value::Int(garbage))
    );
    let family = stats
        .families
        .iter()
        .find(|f| f.name == "softwarp_cm_events_shed_total")
        .unwrap();
    assert!(
        family.samples.iter().any(|x| x.value == Value::Int(shed)),
        "{family:?}"
    );

    // Reading the queue makes room again; a good client is served.
    drop(peers);
    let (_, errors) = drain(&ch, &l);
    assert_eq!(errors, MAX_QUEUED_REQUEST_ERRORS as u64);
    good_client_is_served(&l);
}
