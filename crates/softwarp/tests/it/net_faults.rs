//! Network faults (issue 17): corruption that slips past TCP's checksum, injected above TCP
//! by a relay between the two ends, so that only MPA's CRC can catch it.
//!
//! The relay (`corrupting_relay`) accepts the initiator's TCP connection, connects to the
//! responder, copies bytes both ways and flips one bit of the initiator's stream at a chosen
//! offset after its MPA Request. TCP delivers the flipped byte with a good checksum, as a
//! faulty NIC, bridge or middlebox after the checksum check would.
//!
//! With CRC on, every corruption anywhere in an FPDU (length, headers, payload, pad, CRC) is
//! caught: the responder fails the stream with a Terminate, no receive completes with the
//! corrupted message or any after it, and every completed one holds exactly the bytes sent.
//! With CRC off (siw's default), a flipped payload byte is delivered: that is what the CRC
//! is for, and the test pins it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::util::{pattern, wait_event, wait_state, wait_wcs, End, WAIT};
use softwarp::*;
use softwarp_wire::mpa::frame::HEADER_LEN;

/// Sends per connection, and bytes per Send.
const MSGS: usize = 200;
const LEN: usize = 1000;
/// FPDU bytes before a Send's payload: ULPDU_Length (2), DDP untagged header (14) and RDMAP
/// control fields (4).
const SEND_PREFIX: usize = 2 + 18;

/// A relay from a listening socket to `upstream` that flips `mask` into the byte at offset
/// `flip_at` of the initiator-to-responder stream, counted from the first byte after the
/// MPA Request. Returns its address and the relay thread (which returns the bytes it
/// relayed in that direction).
fn corrupting_relay(
    upstream: SocketAddr,
    flip_at: usize,
    mask: u8,
) -> (SocketAddr, JoinHandle<u64>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + WAIT;
        let down = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "nobody connected to the relay");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("relay accept: {e}"),
            }
        };
        down.set_nonblocking(false).unwrap();
        let up = TcpStream::connect_timeout(&upstream, WAIT).unwrap();
        for s in [&down, &up] {
            s.set_nodelay(true).unwrap();
            s.set_read_timeout(Some(WAIT)).unwrap();
        }
        let back = {
            let (from, to) = (up.try_clone().unwrap(), down.try_clone().unwrap());
            std::thread::spawn(move || copy(from, to, None))
        };
        let n = copy(down, up, Some((flip_at, mask)));
        back.join().unwrap();
        n
    });
    (addr, h)
}

/// Copies `from` to `to` until EOF or an error, then shuts `to`'s write side. With `flip`,
/// XORs the mask into the byte `flip.0` bytes after the MPA Request (whose length comes from
/// its PD_Length, the last two bytes of its 20-byte header, RFC 5044 section 7.1).
fn copy(mut from: TcpStream, mut to: TcpStream, flip: Option<(usize, u8)>) -> u64 {
    let mut buf = vec![0u8; 64 * 1024];
    let mut seen = 0usize;
    let mut request_end: Option<usize> = None;
    let mut header = Vec::new();
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((flip_at, mask)) = flip {
            if request_end.is_none() {
                let take = (HEADER_LEN - header.len()).min(n);
                header.extend_from_slice(&buf[..take]);
                if header.len() == HEADER_LEN {
                    let pd = u16::from_be_bytes([header[HEADER_LEN - 2], header[HEADER_LEN - 1]]);
                    request_end = Some(HEADER_LEN + usize::from(pd));
                }
            }
            if let Some(end) = request_end {
                let at = end + flip_at;
                if (seen..seen + n).contains(&at) {
                    buf[at - seen] ^= mask;
                }
            }
        }
        seen += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    seen as u64
}

/// What one corrupted connection did.
#[derive(Debug)]
struct Outcome {
    /// Receives that completed successfully (a prefix of the Sends, in order).
    delivered: usize,
    /// The responder's QP failed with this cause (`None`: it stayed up).
    cause: Option<Cause>,
    /// The initiator's QP failed with this cause.
    initiator_cause: Option<Cause>,
    /// The responder's received messages, in order.
    received: Vec<Vec<u8>>,
    /// What the initiator sent.
    sent: Vec<Vec<u8>>,
}

/// One connection through the relay: the initiator posts `MSGS` Sends of `LEN` bytes, the
/// responder has `MSGS` receives posted. Waits until every receive completed (or was
/// flushed) and returns what happened.
fn run(crc: bool, flip_at: usize, mask: u8) -> Outcome {
    let opts = ConnectOptions::default().crc_mode(if crc {
        CrcMode::Preferred
    } else {
        CrcMode::Off
    });
    let deep = |attr: &mut QpInitAttr<'_>| {
        attr.cap.max_send_wr = MSGS;
        attr.cap.max_recv_wr = MSGS;
    };
    let a = End::with(None, None, deep);
    let b = End::with(None, None, deep);
    let lw = AccessFlags::LOCAL_WRITE;
    let (sbuf, sdata) = a.mr(MSGS * LEN, lw, 0xc0 ^ flip_at as u64);
    let rbuf = b.pd.reg_mr(MSGS * LEN, lw).unwrap();
    for i in 0..MSGS {
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sgl: SgList::single(rbuf.sge(i * LEN, LEN as u32).unwrap()),
        })
        .unwrap();
    }
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let (relay, h) = corrupting_relay(l.local_addr().unwrap(), flip_at, mask);
    std::thread::scope(|s| {
        let acc = s.spawn(|| l.accept_timeout(&b.qp, &opts, WAIT).unwrap());
        a.qp.connect(relay, &opts).unwrap();
        acc.join().unwrap();
    });
    for i in 0..MSGS {
        a.qp.post_send(&SendWr {
            wr_id: i as u64,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Sgl(SgList::single(sbuf.sge(i * LEN, LEN as u32).unwrap())),
            signaled: true,
            fence: false,
        })
        .unwrap();
    }
    let wcs = wait_wcs(&b.rcq, MSGS);
    let mut received = Vec::new();
    let mut flushed = false;
    for (i, w) in wcs.iter().enumerate() {
        assert_eq!(w.wr_id, i as u64, "receives complete in order: {wcs:?}");
        if w.status == WcStatus::Success {
            assert!(
                !flushed,
                "a receive completed after the stream failed: {wcs:?}"
            );
            assert_eq!(w.byte_len as usize, LEN);
            received.push(rbuf.to_vec().unwrap()[i * LEN..(i + 1) * LEN].to_vec());
        } else {
            assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
            flushed = true;
        }
    }
    let cause = if flushed {
        let c = qp_cause(&b);
        wait_state(&b.qp, QpState::Error);
        assert_eq!(
            b.qp.stats().terminates_sent,
            1,
            "one Terminate for the stream"
        );
        Some(c)
    } else {
        None
    };
    // The initiator learns it from the Terminate.
    let initiator_cause = cause.map(|_| {
        wait_state(&a.qp, QpState::Error);
        qp_cause(&a)
    });
    drop((a.qp, b.qp));
    h.join().unwrap();
    let sent = (0..MSGS)
        .map(|i| sdata[i * LEN..(i + 1) * LEN].to_vec())
        .collect();
    Outcome {
        delivered: received.len(),
        cause,
        initiator_cause,
        received,
        sent,
    }
}

/// The cause of the first error event of `end`'s QP.
fn qp_cause(end: &End) -> Cause {
    let qp_num = end.qp.qp_num();
    let (ev, _) = wait_event(&end.dev, |e| {
        matches!(*e, AsyncEvent::QpFatal { qp_num: q, .. }
            | AsyncEvent::QpRequestError { qp_num: q, .. }
            | AsyncEvent::QpAccessError { qp_num: q, .. } if q == qp_num)
    });
    match ev {
        AsyncEvent::QpFatal { cause, .. }
        | AsyncEvent::QpRequestError { cause, .. }
        | AsyncEvent::QpAccessError { cause, .. } => cause,
        other => panic!("{other:?}"),
    }
}

/// A small deterministic generator for the flip offsets and masks (xorshift64*).
fn offsets(n: usize, below: usize, seed: u64) -> Vec<(usize, u8)> {
    let bytes = pattern(n * 16, seed);
    bytes
        .chunks(16)
        .map(|c| {
            let at = u64::from_le_bytes(c[..8].try_into().unwrap()) as usize % below;
            let mask = 1u8 << (c[8] % 8);
            (at, mask)
        })
        .collect()
}

#[test]
fn with_crc_every_corruption_above_tcp_is_caught_and_nothing_corrupted_is_delivered() {
    // Offsets anywhere in the first half of the stream, so that a corrupted ULPDU_Length
    // (up to 65535) is always followed by enough bytes to reach its CRC.
    let fpdu = SEND_PREFIX + LEN + 4;
    let cases = offsets(16, MSGS / 2 * fpdu, 0x5eed_c0de);
    let mut faults = std::collections::BTreeMap::<String, usize>::new();
    for &(at, mask) in &cases {
        let out = run(true, at, mask);
        let first_bad = at / fpdu;
        assert!(
            out.delivered <= first_bad,
            "flip at {at} (message {first_bad}): {} messages delivered",
            out.delivered
        );
        for (i, got) in out.received.iter().enumerate() {
            assert!(
                *got == out.sent[i],
                "message {i} delivered with wrong bytes (flip at {at})"
            );
        }
        let cause = out
            .cause
            .unwrap_or_else(|| panic!("flip at {at}: the stream did not fail"));
        assert!(
            matches!(
                cause,
                Cause::Detected(Fault::Crc) | Cause::Detected(Fault::BadUlpduLength)
            ),
            "flip at {at} mask {mask:#x}: {cause:?}"
        );
        if cause == Cause::Detected(Fault::Crc) {
            //= https://www.rfc-editor.org/rfc/rfc5044#section-8
            // (paraphrase) LLP layer (2), MPA error type (0), CRC error (2).
            assert_eq!(
                out.initiator_cause,
                Some(Cause::PeerTerminate {
                    layer: 2,
                    etype: 0,
                    code: 2
                }),
                "flip at {at}"
            );
        }
        *faults.entry(format!("{cause:?}")).or_default() += 1;
    }
    println!(
        "corruption above TCP, CRC on: {} connections, {} flips, causes {faults:?}",
        cases.len(),
        cases.len()
    );
}

#[test]
fn without_crc_a_flipped_payload_byte_is_delivered() {
    // The 10th payload byte of message 3: nothing but a CRC could see it.
    let fpdu = SEND_PREFIX + LEN + 4;
    let at = 3 * fpdu + SEND_PREFIX + 9;
    let out = run(false, at, 0x40);
    assert_eq!(out.cause, None, "the stream stays up");
    assert_eq!(out.delivered, MSGS);
    for i in 0..MSGS {
        if i == 3 {
            let mut want = out.sent[3].clone();
            want[9] ^= 0x40;
            assert!(out.received[3] == want, "exactly the flipped byte differs");
        } else {
            assert!(out.received[i] == out.sent[i], "message {i}");
        }
    }
}
