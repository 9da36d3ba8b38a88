//! Small writes held and coalesced as the kernel's TCP holds them: `MSG_MORE`
//! (`IwarpStream::write_more_with`), `TCP_CORK` (`set_cork`), and `TCP_NODELAY`
//! (`set_nodelay`, which sends what is held); and random sequences of writes, flags, reads
//! and peeks over an iWARP stream against the same sequence over kernel TCP, byte-identical.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use std::thread;
use std::time::Duration;

use proptest::prelude::*;
use softwarp_sockets::{IwarpListener, IwarpStream};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(20));

/// A connected pair, (client, server): iWARP mode, or plain kernel TCP through the same API.
fn pair(iwarp: bool) -> (IwarpStream, IwarpStream) {
    let (c, s) = if iwarp {
        let l = IwarpListener::bind_iwarp("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = thread::spawn(move || l.accept().unwrap().0);
        let c = IwarpStream::connect_iwarp(addr).unwrap();
        (c, t.join().unwrap())
    } else {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = IwarpStream::connect(addr).unwrap();
        let s = IwarpStream::from(l.accept().unwrap().0);
        (c, s)
    };
    for x in [&c, &s] {
        x.set_read_timeout(TIMEOUT).unwrap();
        x.set_write_timeout(TIMEOUT).unwrap();
    }
    (c, s)
}

/// DATA messages the stream's QP sent so far.
fn sent_messages(s: &IwarpStream) -> u64 {
    s.qp_stats().unwrap().tx.send.messages
}

#[test]
fn a_corked_streams_small_writes_leave_as_one_message_when_uncorked() {
    let (c, s) = pair(true);
    c.set_cork(true).unwrap();
    assert!(c.cork().unwrap());
    let before = sent_messages(&c);
    let mut want = Vec::new();
    for i in 0..100u8 {
        (&c).write_all(&[i; 10]).unwrap();
        want.extend_from_slice(&[i; 10]);
    }
    assert_eq!(sent_messages(&c), before, "nothing leaves while corked");
    c.set_cork(false).unwrap();
    assert!(!c.cork().unwrap());
    let mut got = vec![0u8; want.len()];
    (&s).read_exact(&mut got).unwrap();
    assert_eq!(got, want);
    assert_eq!(
        sent_messages(&c) - before,
        1,
        "100 corked writes, one message"
    );
}

#[test]
fn msg_more_writes_join_the_next_write_and_nodelay_sends_what_is_held() {
    let (c, s) = pair(true);
    let before = sent_messages(&c);
    for _ in 0..3 {
        assert_eq!(c.write_more_with(b"head", true, false).unwrap(), 4);
    }
    assert_eq!(sent_messages(&c), before, "MSG_MORE holds the bytes");
    (&c).write_all(b"body").unwrap();
    let mut got = [0u8; 16];
    (&s).read_exact(&mut got).unwrap();
    assert_eq!(&got, b"headheadheadbody");
    assert_eq!(sent_messages(&c) - before, 1);
    // Held by MSG_MORE, sent by setting TCP_NODELAY (as the kernel pushes then).
    c.write_more_with(b"tail", true, false).unwrap();
    c.set_nodelay(true).unwrap();
    assert!(c.nodelay().unwrap());
    let mut got = [0u8; 4];
    (&s).read_exact(&mut got).unwrap();
    assert_eq!(&got, b"tail");
    assert_eq!(sent_messages(&c) - before, 2);
}

/// Corked, whole messages leave at once and only the last smaller piece is held; the
/// shutdown sends it before the EOF.
#[test]
fn a_corked_large_write_sends_whole_messages_and_shutdown_sends_the_rest() {
    let (c, s) = pair(true);
    c.set_cork(true).unwrap();
    let data: Vec<u8> = (0..100_005u32).map(|i| (i * 7) as u8).collect();
    let reader = thread::spawn(move || {
        let mut got = Vec::new();
        (&s).read_to_end(&mut got).unwrap();
        got
    });
    (&c).write_all(&data).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(reader.join().unwrap(), data);
}

/// One step of the writer.
#[derive(Debug, Clone)]
enum Op {
    /// Write this many bytes, with `MSG_MORE` or not.
    Write(usize, bool),
    Cork(bool),
    NoDelay,
}

/// One step of the reader.
#[derive(Debug, Clone)]
enum Rd {
    /// Read into a buffer of this size (`MSG_WAITALL`: until it is full or the end).
    Read(usize, bool),
    /// Peek this many bytes (`MSG_PEEK`, with `MSG_WAITALL` or not).
    Peek(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..3000, any::<bool>()).prop_map(|(n, m)| Op::Write(n, m)),
        1 => (1usize..70_000, any::<bool>()).prop_map(|(n, m)| Op::Write(n, m)),
        1 => any::<bool>().prop_map(Op::Cork),
        1 => Just(Op::NoDelay),
    ]
}

fn rd() -> impl Strategy<Value = Rd> {
    prop_oneof![
        4 => (1usize..40_000, any::<bool>()).prop_map(|(n, w)| Rd::Read(n, w)),
        1 => (1usize..5000, any::<bool>()).prop_map(|(n, w)| Rd::Peek(n, w)),
    ]
}

/// Runs the writer's `ops` (then a shutdown) against a reader that follows `reads` (over
/// and over) to the end; returns what each read and peek returned, in order.
fn run(iwarp: bool, ops: &[Op], reads: &[Rd]) -> Vec<Vec<u8>> {
    let (c, s) = pair(iwarp);
    let reads = reads.to_vec();
    let reader = thread::spawn(move || {
        let mut out = Vec::new();
        for r in reads.iter().cycle() {
            match *r {
                Rd::Read(n, all) => {
                    let mut buf = vec![0u8; n];
                    let mut got = 0;
                    loop {
                        let k = (&s).read(&mut buf[got..]).unwrap();
                        got += k;
                        if k == 0 || !all || got == n {
                            break;
                        }
                    }
                    buf.truncate(got);
                    let end = got == 0;
                    out.push(buf);
                    if end {
                        return out;
                    }
                }
                Rd::Peek(n, all) => {
                    let mut buf = vec![0u8; n];
                    let k = s.peek_with(&mut buf, all, false).unwrap();
                    if k == 0 {
                        return out;
                    }
                    buf.truncate(k);
                    // How much a peek sees depends on how the bytes arrived: the read
                    // that follows must return the same bytes.
                    let mut check = vec![0u8; k];
                    (&s).read_exact(&mut check).unwrap();
                    assert_eq!(check, buf, "a read returns what the peek saw");
                    out.push(check);
                }
            }
        }
        out
    });
    let mut next = 0u8;
    for op in ops {
        match *op {
            Op::Write(n, more) => {
                let data: Vec<u8> = (0..n)
                    .map(|_| {
                        next = next.wrapping_add(31);
                        next
                    })
                    .collect();
                let mut at = 0;
                while at < n {
                    at += c.write_more_with(&data[at..], more, false).unwrap();
                }
            }
            Op::Cork(on) => c.set_cork(on).unwrap(),
            Op::NoDelay => c.set_nodelay(true).unwrap(),
        }
    }
    c.shutdown(Shutdown::Write).unwrap();
    reader.join().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// The same writes (sizes, `MSG_MORE`, cork, nodelay) and the same reads (sizes,
    /// `MSG_WAITALL`, `MSG_PEEK`) over an iWARP stream and over kernel TCP: the stream of
    /// bytes is identical (how reads without `MSG_WAITALL` split it depends on timing on
    /// both, so the concatenation is compared).
    #[test]
    fn writes_and_reads_match_kernel_tcp_byte_for_byte(
        ops in proptest::collection::vec(op(), 1..40),
        reads in proptest::collection::vec(rd(), 1..8),
    ) {
        let iwarp: Vec<u8> = run(true, &ops, &reads).concat();
        let tcp: Vec<u8> = run(false, &ops, &reads).concat();
        prop_assert_eq!(iwarp.len(), tcp.len());
        prop_assert!(iwarp == tcp, "the bytes differ");
    }
}
