//! Awaiting costs no CPU: with completions, CM events and device events awaited on a
//! multi-threaded tokio runtime and nothing arriving, the process uses (almost) no CPU time
//! over 500 ms; the first message then wakes its waiter. In the `whole_process` binary, one
//! test at a time (`serial`), so that no other test's work is counted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use softwarp::*;

const WAIT: Duration = Duration::from_secs(20);
const IDLE: Duration = Duration::from_millis(500);
/// CPU time the whole process may use while idle for [`IDLE`]: 5 %. A task or thread that
/// polled in a loop would use about 100 % of a core.
const IDLE_CPU_MAX: Duration = Duration::from_millis(25);

/// CPU time used so far by every thread of this process (the first field of each
/// `/proc/self/task/*/schedstat`: nanoseconds on a CPU).
fn process_cpu() -> Duration {
    let mut ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path().join("schedstat");
        // A thread may end between the listing and the read.
        if let Ok(text) = std::fs::read_to_string(path) {
            let first = text.split_whitespace().next().unwrap_or("0");
            ns += first.parse::<u64>().unwrap_or(0);
        }
    }
    Duration::from_nanos(ns)
}

// The guard is held across awaits on purpose: `#[tokio::test]` runs this future on the test's
// own thread (`block_on`), and the lock keeps the other whole-process tests out until it ends.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_awaits_use_no_cpu_and_wake_at_the_first_message() {
    let _serial = softwarp_testkit::serial();
    let sdev = Device::open_default().unwrap();
    let cdev = Device::open_default().unwrap();
    let spd = sdev.alloc_pd().unwrap();
    let cpd = cdev.alloc_pd().unwrap();
    let srcq = Arc::new(sdev.create_async_cq(64).unwrap());
    let sscq = sdev.create_async_cq(64).unwrap();
    let crcq = cdev.create_async_cq(64).unwrap();
    let cscq = Arc::new(cdev.create_async_cq(64).unwrap());
    let sqp = spd
        .create_qp(&QpInitAttr::new(sscq.cq(), srcq.cq()))
        .unwrap();
    let cqp = cpd
        .create_qp(&QpInitAttr::new(cscq.cq(), crcq.cq()))
        .unwrap();
    let recv = spd
        .reg_owned_writable(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
        .unwrap();
    sqp.post_recv(&RecvWr {
        wr_id: 7,
        sgl: SgList::single(recv.sge(0, 64).unwrap()),
    })
    .unwrap();

    let schan = Arc::new(CmEventChannel::new().unwrap());
    let cchan = Arc::new(CmEventChannel::new().unwrap());
    let listener = schan
        .listen("127.0.0.1:0", &ListenOptions::default())
        .unwrap();
    let addr = listener.local_addr();
    let opts = ConnectOptions::default();
    let (accepted, connected) = tokio::join!(
        listener.accept_async(&sqp, &opts),
        cchan.connect_async(&cqp, addr, &opts)
    );
    let (_sid, _) = accepted.unwrap();
    let (_cid, _) = connected.unwrap();

    // Waiters with nothing to wake them: the server's receive, the client's send CQ, the
    // server's CM channel, a picky wait on the client's, and both devices' events.
    let recv_waiter = {
        let srcq = Arc::clone(&srcq);
        tokio::spawn(async move { srcq.next().await })
    };
    let send_waiter = {
        let cscq = Arc::clone(&cscq);
        tokio::spawn(async move { cscq.next().await })
    };
    let cm_waiter = {
        let schan = Arc::clone(&schan);
        tokio::spawn(async move { schan.next_event().await.map(|e| e.name()) })
    };
    // A wait for one kind of event while another stays queued: the channel's descriptor
    // stays readable all along, and the waiter must still sleep.
    let spare = cpd
        .create_qp(&QpInitAttr::new(cscq.cq(), crcq.cq()))
        .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    cchan.connect(&spare, closed_addr, &opts).unwrap();
    while cchan.pending_events() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let picky_waiter = {
        let cchan = Arc::clone(&cchan);
        tokio::spawn(async move {
            cchan
                .next_event_matching(|e| matches!(e, CmEvent::TimewaitExit { .. }))
                .await
                .map(|e| e.name())
        })
    };
    let dev_waiters = [sdev.clone(), cdev.clone()]
        .map(|d| tokio::spawn(async move { d.next_async_event().await }));
    // Let every task reach its wait.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let cpu0 = process_cpu();
    let t0 = Instant::now();
    tokio::time::sleep(IDLE).await;
    let wall = t0.elapsed();
    let cpu = process_cpu().saturating_sub(cpu0);
    println!(
        "idle: {:.3} ms of CPU over {:.1} ms with 6 pending awaits ({:.2} %)",
        cpu.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        cpu.as_secs_f64() / wall.as_secs_f64() * 100.0
    );
    assert!(
        cpu < IDLE_CPU_MAX,
        "{cpu:?} of CPU while idle for {wall:?} (at most {IDLE_CPU_MAX:?})"
    );
    assert!(!recv_waiter.is_finished() && !send_waiter.is_finished());
    assert!(!cm_waiter.is_finished() && !picky_waiter.is_finished());
    assert_eq!(
        cchan.pending_events(),
        1,
        "the unreachable attempt's event stays queued"
    );

    // The first message wakes both completion waiters.
    let msg = cpd.reg_owned(b"wake up".to_vec()).unwrap();
    cqp.post_send(&SendWr {
        wr_id: 9,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        payload: Payload::Sgl(SgList::single(msg.sge(0, 7).unwrap())),
        signaled: true,
        fence: false,
    })
    .unwrap();
    let sent = tokio::time::timeout(WAIT, send_waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((sent.wr_id, sent.status), (9, WcStatus::Success));
    let got = tokio::time::timeout(WAIT, recv_waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((got.wr_id, got.byte_len), (7, 7));
    assert_eq!(&recv.into_inner(WAIT).unwrap()[..7], b"wake up");
    assert_eq!(&msg.into_inner(WAIT).unwrap()[..], b"wake up");
    cm_waiter.abort();
    picky_waiter.abort();
    for w in dev_waiters {
        w.abort();
    }
}
