//! The `tokio` feature: `AsyncRead`/`AsyncWrite` over iWARP streams, both ends async in one
//! multi-threaded runtime, the halves of `tokio::io::split` in different tasks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use softwarp_sockets::{AsyncIwarpStream, IwarpListener, IwarpStream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// An iWARP-mode pair (connect and accept block: threads of their own).
fn pair() -> (IwarpStream, IwarpStream) {
    let l = IwarpListener::bind_iwarp("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || l.accept().unwrap().0);
    let c = IwarpStream::connect_iwarp(addr).unwrap();
    (c, t.join().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_through_split_halves_in_separate_tasks() {
    let (c, s) = pair();
    let c = AsyncIwarpStream::new(c).unwrap();
    let s = AsyncIwarpStream::new(s).unwrap();
    // The server echoes with tokio::io::copy between its own split halves.
    let server = tokio::spawn(async move {
        let (mut r, mut w) = tokio::io::split(s);
        let n = tokio::io::copy(&mut r, &mut w).await.unwrap();
        w.shutdown().await.unwrap();
        n
    });
    let data = pattern((3 << 20) + 4321, 5);
    let (mut r, mut w) = tokio::io::split(c);
    let out = data.clone();
    let writer = tokio::spawn(async move {
        for chunk in out.chunks(100_000) {
            w.write_all(chunk).await.unwrap();
        }
        w.shutdown().await.unwrap();
    });
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut back))
        .await
        .expect("the echo within 60 s")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(server.await.unwrap(), data.len() as u64);
    assert_eq!(back.len(), data.len());
    assert!(back == data, "the echoed bytes differ");
}

/// A waker that counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Polls an async stream by hand with a counting waker.
struct Probe {
    count: Arc<Count>,
    waker: Waker,
}

impl Probe {
    fn new() -> Self {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        Self { count, waker }
    }

    fn woken(&self) -> usize {
        self.count.0.load(Ordering::SeqCst)
    }

    fn read(&self, c: &mut AsyncIwarpStream, rb: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(c).poll_read(&mut Context::from_waker(&self.waker), rb)
    }

    fn write(&self, c: &mut AsyncIwarpStream, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(c).poll_write(&mut Context::from_waker(&self.waker), buf)
    }
}

/// An iWARP pair, the first end async (in the current runtime).
fn async_pair() -> (AsyncIwarpStream, IwarpStream) {
    let (c, s) = pair();
    (AsyncIwarpStream::new(c).unwrap(), s)
}

/// Polls `c` (nobody else reading it) until `ready` says the side a parked task waits for
/// can go on, so that this poll, not the runtime, takes the completion and drains the
/// channel; polls again a moment later for a channel write that trailed its completion,
/// then lets the runtime's reactor run.
async fn taken_by_another_poll(
    c: &AsyncIwarpStream,
    ready: fn(&softwarp_sockets::Readiness) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready(&c.get_ref().poll_ready()) {
        assert!(Instant::now() < deadline, "the completion within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    c.get_ref().poll_ready();
    // A current-thread runtime runs its reactor only here: the event, if the channel still
    // held one, would wake the task through its `AsyncFd`.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// A completion that another poll of the stream takes (the other half of a split, or
/// `poll_ready`) drains the completion channel before the reactor sees it: the parked
/// reader must be woken by that poll, or it sleeps forever.
#[tokio::test(flavor = "current_thread")]
async fn a_reader_is_woken_when_another_poll_takes_its_data() {
    let (mut c, mut s) = async_pair();
    let probe = Probe::new();
    let mut buf = [0u8; 16];
    let mut rb = ReadBuf::new(&mut buf);
    assert!(probe.read(&mut c, &mut rb).is_pending());
    s.write_all(b"hello").unwrap();
    taken_by_another_poll(&c, |r| r.readable).await;
    assert!(probe.woken() >= 1, "the parked reader was never woken");
    assert!(matches!(probe.read(&mut c, &mut rb), Poll::Ready(Ok(()))));
    assert_eq!(rb.filled(), b"hello");
}

/// The same for a writer parked for credits: the peer's read returns them, another poll
/// takes the grant.
#[tokio::test(flavor = "current_thread")]
async fn a_writer_is_woken_when_another_poll_takes_its_credits() {
    let (mut c, mut s) = async_pair();
    let probe = Probe::new();
    let chunk = vec![7u8; 1 << 16];
    let mut sent = 0usize;
    let mut parked = false;
    for _ in 0..10_000 {
        match probe.write(&mut c, &chunk) {
            Poll::Ready(Ok(n)) => sent += n,
            Poll::Ready(Err(e)) => panic!("{e}"),
            Poll::Pending => {
                parked = true;
                break;
            }
        }
    }
    assert!(parked, "the writer never ran out of credits");
    let before = probe.woken();
    let mut got = 0usize;
    let mut sink = vec![0u8; 1 << 16];
    while got < sent {
        got += s.read(&mut sink).unwrap();
    }
    taken_by_another_poll(&c, |r| r.writable).await;
    assert!(probe.woken() > before, "the parked writer was never woken");
    assert!(matches!(probe.write(&mut c, &chunk), Poll::Ready(Ok(_))));
}

/// A channel event that another poll consumes disarmed its CQ: here a WINDOW
/// advertisement (no event of either direction) arrives while a reader is parked and a
/// blocking call takes it. The CQs must be armed again for the reader, or the data that
/// follows signals nobody.
#[tokio::test(flavor = "current_thread")]
async fn a_reader_hears_of_data_after_another_poll_consumed_a_control_message() {
    let (mut c, mut s) = async_pair();
    let probe = Probe::new();
    let mut buf = [0u8; 16];
    let mut rb = ReadBuf::new(&mut buf);
    assert!(probe.read(&mut c, &mut rb).is_pending());
    let _window = s.expose(4096, 0).unwrap();
    c.get_ref()
        .wait_peer_window(0, 4096, Duration::from_secs(10))
        .unwrap();
    assert_eq!(probe.woken(), 0, "a window is not data");
    s.write_all(b"after").unwrap();
    // Only the reactor can hear of it now: nobody else polls the stream.
    let deadline = Instant::now() + Duration::from_secs(10);
    while probe.woken() == 0 {
        assert!(
            Instant::now() < deadline,
            "the parked reader was never woken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(probe.read(&mut c, &mut rb), Poll::Ready(Ok(()))));
    assert_eq!(rb.filled(), b"after");
}

#[tokio::test]
async fn a_plain_stream_or_no_runtime_is_refused() {
    let l = IwarpListener::bind("127.0.0.1:0").unwrap();
    let plain = IwarpStream::connect(l.local_addr().unwrap()).unwrap();
    let e = AsyncIwarpStream::new(plain).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported);
    let (c, s) = pair();
    let err = std::thread::spawn(move || AsyncIwarpStream::new(c).map(|_| ()))
        .join()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("tokio runtime"), "{err}");
    s.shutdown(Shutdown::Both).unwrap();
}
