//! The `tokio` feature: `AsyncRead`/`AsyncWrite` over iWARP streams, both ends async in one
//! multi-threaded runtime, the halves of `tokio::io::split` in different tasks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::Shutdown;
use std::time::Duration;

use softwarp_sockets::{AsyncIwarpStream, IwarpListener, IwarpStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
