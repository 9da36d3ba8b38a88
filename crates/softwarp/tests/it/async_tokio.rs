//! The `tokio` feature: thousands of concurrent Sends and RDMA Writes over 16 connections
//! on a multi-threaded runtime with every completion awaited, connections made and accepted
//! with the async CM calls, and the async waits of the CM and device event channels.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::util::pattern;
use futures_core::Stream;
use softwarp::*;

const QPS: usize = 16;
const MSGS: usize = 256;
const MSG: usize = 256;
const WAIT: Duration = Duration::from_secs(60);

fn cap() -> QpCap {
    QpCap {
        max_send_wr: MSGS,
        max_recv_wr: MSGS,
        ..QpCap::default()
    }
}

/// The server half of one connection: its QP, a CQ awaited for its receives, the receive
/// buffer (Sends land there) and the buffer the client RDMA Writes into.
struct ServerSide {
    qp: QueuePair,
    rcq: AsyncCq,
    _scq: AsyncCq,
    recv: OwnedMr<Vec<u8>, owned::Writable>,
    target: OwnedMr<Box<[u8]>, owned::Writable>,
}

/// Message `i` of connection `q`: even ones are RDMA Writes to `target` at `i * MSG`, odd
/// ones Sends into the next receive slot (`(i / 2) * MSG` of `recv`). The last is a Send,
/// so its receive completion comes after every Write before it was placed.
fn is_write(i: usize) -> bool {
    i.is_multiple_of(2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_sends_and_writes_over_16_qps_are_awaited() {
    let sdev = Device::open_default().unwrap();
    let cdev = Device::open_default().unwrap();
    let spd = sdev.alloc_pd().unwrap();
    let cpd = cdev.alloc_pd().unwrap();

    // Server resources for every connection, receives posted before accepting.
    let mut servers = Vec::new();
    for _ in 0..QPS {
        let rcq = sdev.create_async_cq(MSGS).unwrap();
        let scq = sdev.create_async_cq(MSGS).unwrap();
        let mut attr = QpInitAttr::new(scq.cq(), rcq.cq());
        attr.cap = cap();
        let qp = spd.create_qp(&attr).unwrap();
        let recv = spd
            .reg_owned_writable(vec![0u8; MSGS / 2 * MSG], AccessFlags::LOCAL_WRITE)
            .unwrap();
        let target = spd
            .reg_owned_writable(
                vec![0u8; MSGS * MSG].into_boxed_slice(),
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let wrs: Vec<RecvWr> = (0..MSGS / 2)
            .map(|k| RecvWr {
                wr_id: k as u64,
                sgl: SgList::single(recv.sge(k * MSG, MSG as u32).unwrap()),
            })
            .collect();
        qp.post_recv_list(&wrs).unwrap();
        servers.push(ServerSide {
            qp,
            rcq,
            _scq: scq,
            recv,
            target,
        });
    }
    let remote: Vec<(u64, Stag)> = servers
        .iter()
        .map(|s| (s.target.addr(), s.target.rkey()))
        .collect();

    // The server accepts each request into the QP the client names in its private data.
    let schan = Arc::new(CmEventChannel::new().unwrap());
    let listener = schan
        .listen("127.0.0.1:0", &ListenOptions::default())
        .unwrap();
    let addr = listener.local_addr();
    let servers = Arc::new(servers);
    let acceptor = {
        let servers = Arc::clone(&servers);
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for _ in 0..QPS {
                let req = listener.get_request_async().await.unwrap();
                let q = usize::from(req.private_data()[0]);
                ids.push(
                    req.accept(&servers[q].qp, &ConnectOptions::default())
                        .unwrap(),
                );
            }
            (listener, ids)
        })
    };

    // Each server connection awaits its receives in its own task.
    let mut receivers = Vec::new();
    for q in 0..QPS {
        let servers = Arc::clone(&servers);
        receivers.push(tokio::spawn(async move {
            let s = &servers[q];
            let mut wcs = [EMPTY_COMPLETION; 32];
            let mut got = 0;
            while got < MSGS / 2 {
                let n = s.rcq.next_batch(&mut wcs).await.unwrap();
                for wc in &wcs[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    assert_eq!(wc.wr_id, (got) as u64, "receives complete in order");
                    assert_eq!(wc.byte_len as usize, MSG);
                    got += 1;
                }
            }
        }));
    }

    // Client connections, made concurrently, each posting all of its messages at once from
    // one owned buffer and awaiting every completion.
    let cchan = Arc::new(CmEventChannel::new().unwrap());
    let mut clients = Vec::new();
    for (q, &(raddr, rkey)) in remote.iter().enumerate() {
        let cdev = cdev.clone();
        let cpd = cpd.clone();
        let cchan = Arc::clone(&cchan);
        clients.push(tokio::spawn(async move {
            let scq = cdev.create_async_cq(MSGS).unwrap();
            let rcq = cdev.create_async_cq(MSGS).unwrap();
            let mut attr = QpInitAttr::new(scq.cq(), rcq.cq());
            attr.cap = cap();
            let qp = cpd.create_qp(&attr).unwrap();
            let opts = ConnectOptions::default().private_data(&[q as u8]);
            let (id, _info) = cchan.connect_async(&qp, addr, &opts).await.unwrap();

            // The message bytes, built in place in a registered Vec.
            let mut buf = cpd.reg_owned(vec![0u8; MSGS * MSG]).unwrap();
            buf.edit()
                .unwrap()
                .copy_from_slice(&pattern(MSGS * MSG, q as u64));
            let wrs: Vec<SendWr<'_>> = (0..MSGS)
                .map(|i| SendWr {
                    wr_id: i as u64,
                    op: if is_write(i) {
                        SendOp::Write {
                            remote_addr: raddr + (i * MSG) as u64,
                            rkey,
                        }
                    } else {
                        SendOp::Send {
                            solicited: false,
                            invalidate: None,
                        }
                    },
                    payload: Payload::Sgl(SgList::single(buf.sge(i * MSG, MSG as u32).unwrap())),
                    signaled: true,
                    fence: false,
                })
                .collect();
            qp.post_send_list(&wrs).unwrap();
            let mut done = vec![false; MSGS];
            for _ in 0..MSGS {
                let wc = scq.next().await.unwrap();
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                assert!(!std::mem::replace(&mut done[wc.wr_id as usize], true));
            }
            // Nothing uses the buffer any more: it comes back, the same allocation.
            let addr_before = buf.addr();
            let v = tokio::time::timeout(WAIT, buf.into_inner_async())
                .await
                .unwrap();
            assert_eq!(v.as_ptr() as u64, addr_before);
            assert_eq!(v, pattern(MSGS * MSG, q as u64));
            (qp, id, scq, rcq)
        }));
    }

    let mut kept = Vec::new();
    for c in clients {
        kept.push(tokio::time::timeout(WAIT, c).await.unwrap().unwrap());
    }
    for r in receivers {
        tokio::time::timeout(WAIT, r).await.unwrap().unwrap();
    }
    let (listener, ids) = acceptor.await.unwrap();

    // Every byte where it belongs.
    let servers = Arc::into_inner(servers).expect("every task ended");
    for (q, s) in servers.into_iter().enumerate() {
        let sent = pattern(MSGS * MSG, q as u64);
        let recv = s.recv.into_inner(WAIT).unwrap();
        let target = s.target.into_inner(WAIT).unwrap();
        for i in 0..MSGS {
            let msg = &sent[i * MSG..(i + 1) * MSG];
            if is_write(i) {
                assert_eq!(&target[i * MSG..(i + 1) * MSG], msg, "qp {q} write {i}");
            } else {
                let k = i / 2;
                assert_eq!(&recv[k * MSG..(k + 1) * MSG], msg, "qp {q} send {i}");
            }
        }
        drop(s.qp);
    }
    drop((kept, ids, listener));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_one_connection_wakes_while_other_events_stay_queued() {
    let sdev = Device::open_default().unwrap();
    let cdev = Device::open_default().unwrap();
    let spd = sdev.alloc_pd().unwrap();
    let cpd = cdev.alloc_pd().unwrap();
    let scq = sdev.create_cq(16, None).unwrap();
    let ccq = cdev.create_cq(16, None).unwrap();
    let sqp = spd.create_qp(&QpInitAttr::new(&scq, &scq)).unwrap();
    let cqp = cpd.create_qp(&QpInitAttr::new(&ccq, &ccq)).unwrap();
    let lost = cpd.create_qp(&QpInitAttr::new(&ccq, &ccq)).unwrap();

    // A port nobody listens on: its attempt ends with an event nobody takes.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let cchan = CmEventChannel::new().unwrap();
    let unreachable = cchan
        .connect(&lost, closed_addr, &ConnectOptions::default())
        .unwrap();
    let ev = cchan
        .next_event_matching(|e| e.conn_id() == Some(unreachable.conn_id()))
        .await
        .unwrap();
    assert!(matches!(ev, CmEvent::Unreachable { .. }), "{ev:?}");
    // Left queued on purpose: an event for another connection.
    let again = cchan
        .connect(&lost, closed_addr, &ConnectOptions::default())
        .unwrap();
    while cchan.pending_events() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let schan = CmEventChannel::new().unwrap();
    let listener = schan
        .listen("127.0.0.1:0", &ListenOptions::default())
        .unwrap();
    let addr = listener.local_addr();
    let cchan = Arc::new(cchan);
    let cqp = Arc::new(cqp);
    // In a task of its own, so that nothing but its own events wakes it (the timeout below
    // polls the join handle, not the waits): well below any timer of the stack (5 s).
    let task = {
        let (cchan, cqp) = (Arc::clone(&cchan), Arc::clone(&cqp));
        tokio::spawn(async move {
            let opts = ConnectOptions::default();
            let (accepted, connected) = tokio::join!(
                listener.accept_async(&sqp, &opts),
                cchan.connect_async(&cqp, addr, &opts)
            );
            (accepted.map(|(_, i)| i), connected.map(|(_, i)| i), sqp)
        })
    };
    let (accepted, connected, _sqp) = tokio::time::timeout(Duration::from_secs(3), task)
        .await
        .expect("the connect and the accept are awaited while another event is queued")
        .unwrap();
    let sinfo = accepted.unwrap();
    let cinfo = connected.unwrap();
    assert_eq!(sinfo.revision, cinfo.revision);
    assert_eq!(cqp.state(), QpState::Rts);
    // The other connection's event is still there, in the stream of events.
    let mut events = cchan.events().unwrap();
    let ev = poll_fn(|cx| Pin::new(&mut events).poll_next(cx))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev.conn_id(), Some(again.conn_id()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_events_are_awaited_and_streamed() {
    let dev = Device::open_default().unwrap();
    let waiter = {
        let dev = dev.clone();
        tokio::spawn(async move { dev.next_async_event().await })
    };
    let mut stream = dev.async_events().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "no event yet");
    dev.inject_fatal_error();
    // A fault of a failed device is no second event.
    dev.inject_fatal_error();
    let first = tokio::time::timeout(WAIT, waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first, AsyncEvent::DeviceFatal);
    // The device holds nothing: it recovers at once (unless an automatic recovery did
    // already), and the next fault is the next event.
    let _ = dev.recover(&RecoveryConfig::default());
    assert_eq!(dev.state(), DeviceState::Operational);
    dev.inject_fatal_error();
    let second = tokio::time::timeout(WAIT, poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(second, AsyncEvent::DeviceFatal);
    assert!(dev.try_get_async_event().is_none());
}

#[test]
fn async_calls_outside_a_runtime_are_refused() {
    let dev = Device::open_default().unwrap();
    assert!(matches!(
        dev.create_async_cq(4),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(dev.async_events(), Err(Error::InvalidArgument(_))));
}
