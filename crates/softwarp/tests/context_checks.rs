//! Context checks (issue 16): a blocking call made from a callback on a device's progress
//! thread returns `Error::WouldDeadlock` naming the call and the context, instead of
//! hanging; so does one made from a callback inside a Softwarp call on the application's
//! thread. The callbacks are the application's own `tracing` layer (this test installs it
//! as the process's subscriber): Softwarp emits records on its progress thread, and the
//! layer makes every blocking call of the API when it sees the first one there.
//!
//! A binary of its own (not a module of `it`): a process has one global subscriber, and the
//! tests of `it` install Softwarp's own (`util::opt_in_ras`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use softwarp::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

const WAIT: Duration = Duration::from_secs(20);

/// What the callbacks use (made on the test's thread, shared with the callback).
struct Objects {
    dev: Device,
    channel: CompletionChannel,
    idle_qp: QueuePair,
    listener: Listener,
    cm: CmEventChannel,
    cm_listener: CmListener,
    release: MrRelease,
}

/// The objects, while the progress-thread callback is armed.
static ARMED: Mutex<Option<Arc<Objects>>> = Mutex::new(None);
/// What each call returned on the progress thread: (call, result as text, error).
#[allow(clippy::type_complexity)]
static RESULTS: Mutex<Option<Vec<(&'static str, Result<String, Error>)>>> = Mutex::new(None);
/// Armed for the callback inside a call on the test's thread.
static INSIDE_ARMED: AtomicBool = AtomicBool::new(false);
static INSIDE_RESULT: Mutex<Option<Result<(), Error>>> = Mutex::new(None);
static INSIDE_CHANNEL: Mutex<Option<CompletionChannel>> = Mutex::new(None);
/// The thread named `stuck-in-reg-mr` waits inside `reg_mr` until this is set.
static RELEASE_STUCK: AtomicBool = AtomicBool::new(false);
static STUCK_INSIDE: AtomicBool = AtomicBool::new(false);

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        }
    }
}

fn every_blocking_call(o: &Objects) -> Vec<(&'static str, Result<String, Error>)> {
    let opts = ConnectOptions::default();
    let show = |r: Result<String, Error>| r;
    vec![
        (
            "Device::get_async_event",
            show(o.dev.get_async_event().map(|e| format!("{e:?}"))),
        ),
        (
            "Device::get_async_event_timeout",
            o.dev
                .get_async_event_timeout(Duration::from_secs(2))
                .map(|e| format!("{e:?}")),
        ),
        (
            "CompletionChannel::get_cq_event",
            o.channel.get_cq_event(None).map(|_| "a CQ".into()),
        ),
        (
            "QueuePair::connect",
            o.idle_qp
                .connect("127.0.0.1:1", &opts)
                .map(|i| format!("{i:?}")),
        ),
        (
            "Listener::accept",
            o.listener
                .accept_timeout(&o.idle_qp, &opts, Duration::from_secs(2))
                .map(|i| format!("{i:?}")),
        ),
        (
            "QueuePair::wait_closed",
            o.idle_qp
                .wait_closed(Duration::from_secs(2))
                .map(|s| format!("{s:?}")),
        ),
        (
            "CmEventChannel::connect_blocking",
            o.cm.connect_blocking(&o.idle_qp, "127.0.0.1:1", &opts)
                .map(|(_, i)| format!("{i:?}")),
        ),
        (
            "CmEventChannel::get_event",
            o.cm.get_event(None).map(|e| format!("{e:?}")),
        ),
        (
            "CmListener::get_request",
            o.cm_listener
                .get_request(Some(Duration::from_secs(2)))
                .map(|_| "a request".into()),
        ),
        (
            "MrRelease::wait",
            o.release
                .wait(Duration::from_secs(2))
                .map(|()| "released".into()),
        ),
        (
            "Device::quiesce",
            o.dev
                .quiesce(Duration::from_secs(1))
                .map(|_| "quiesced".into()),
        ),
        (
            "Device::close",
            o.dev
                .clone()
                .close(Duration::from_secs(1))
                .map(|()| "closed".into()),
        ),
    ]
}

struct Callbacks;

impl<S: Subscriber> Layer<S> for Callbacks {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut msg = Message(String::new());
        event.record(&mut msg);
        let thread = std::thread::current();
        let on_progress = thread.name().is_some_and(|n| n.ends_with("-progress"));
        if on_progress {
            let armed = ARMED.lock().unwrap().take();
            if let Some(objects) = armed {
                let mut results = every_blocking_call(&objects);
                // A wait that cannot block is allowed anywhere.
                results.push((
                    "get_cq_event(Some(0)) is not blocking",
                    match objects.channel.get_cq_event(Some(Duration::ZERO)) {
                        Err(Error::Timeout(_)) => Ok("timeout".into()),
                        other => Err(other.err().unwrap_or(Error::InvalidArgument("a CQ?"))),
                    },
                ));
                *RESULTS.lock().unwrap() = Some(results);
            }
        } else if msg.0 == "memory registered" && thread.name() == Some("stuck-in-reg-mr") {
            // A thread that stays inside an entry point (bounded).
            STUCK_INSIDE.store(true, Ordering::Release);
            let deadline = Instant::now() + WAIT;
            while !RELEASE_STUCK.load(Ordering::Acquire) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        } else if msg.0 == "memory registered" && INSIDE_ARMED.swap(false, Ordering::AcqRel) {
            let channel = INSIDE_CHANNEL.lock().unwrap().clone().unwrap();
            let r = channel
                .get_cq_event(Some(Duration::from_secs(2)))
                .map(|_| ());
            *INSIDE_RESULT.lock().unwrap() = Some(r);
        }
    }
}

#[test]
fn blocking_calls_from_callbacks_on_the_progress_thread_or_inside_a_call_are_refused() {
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Callbacks))
        .expect("this test's process has no subscriber yet");
    let dev = Device::open_default().unwrap();
    let peer_dev = Device::open_default().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let peer_pd = peer_dev.alloc_pd().unwrap();
    let channel = dev.create_comp_channel().unwrap();
    let cq = dev.create_cq(64, Some(&channel)).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let idle_qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let pcq = peer_dev.create_cq(64, None).unwrap();
    let pqp = peer_pd.create_qp(&QpInitAttr::new(&pcq, &pcq)).unwrap();
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let opts = ConnectOptions::default();
    std::thread::scope(|s| {
        let h = s.spawn(|| l.accept_timeout(&pqp, &opts, WAIT).unwrap());
        qp.connect(addr, &opts).unwrap();
        h.join().unwrap();
    });
    let cm = CmEventChannel::new().unwrap();
    let cm_listener = cm.listen("127.0.0.1:0", &ListenOptions::default()).unwrap();
    let release = pd.reg_mr(64, AccessFlags::NONE).unwrap().deregister();
    let objects = Arc::new(Objects {
        dev: dev.clone(),
        channel: channel.clone(),
        idle_qp,
        listener: Listener::bind("127.0.0.1:0").unwrap(),
        cm,
        cm_listener,
        release,
    });
    *ARMED.lock().unwrap() = Some(Arc::clone(&objects));

    // The graceful close makes the progress thread trace ("connection: FIN sent"): the
    // callback runs there.
    qp.disconnect().unwrap();
    let deadline = Instant::now() + WAIT;
    let results = loop {
        if let Some(r) = RESULTS.lock().unwrap().take() {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "the callback did not run on the progress thread"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let (nonblocking, blocking) = results.split_last().unwrap();
    assert_eq!(blocking.len(), 12);
    for (call, r) in blocking {
        match r {
            Err(Error::WouldDeadlock {
                call: named,
                context: BlockingContext::ProgressThread,
            }) => {
                assert_eq!(named, call);
                let text = r.as_ref().unwrap_err().to_string();
                assert!(
                    text.contains(call) && text.contains("progress thread"),
                    "{text}"
                );
            }
            other => panic!("{call} on the progress thread: {other:?}"),
        }
    }
    assert!(nonblocking.1.is_ok(), "{nonblocking:?}");
    println!(
        "{} blocking calls refused on the progress thread, e.g.: {}",
        blocking.len(),
        blocking[0].1.as_ref().unwrap_err()
    );
    // The device is untouched by the refused close and quiesce.
    assert!(dev.alloc_pd().is_ok());

    // A callback inside a call on this thread (a record emitted inside reg_mr).
    *INSIDE_CHANNEL.lock().unwrap() = Some(channel.clone());
    INSIDE_ARMED.store(true, Ordering::Release);
    let mr = pd.reg_mr(64, AccessFlags::NONE).unwrap();
    match INSIDE_RESULT.lock().unwrap().take() {
        Some(Err(Error::WouldDeadlock {
            call: "CompletionChannel::get_cq_event",
            context: BlockingContext::InsideCall("ProtectionDomain::reg_mr"),
        })) => {}
        other => panic!("get_cq_event inside reg_mr: {other:?}"),
    }
    // Outside every callback the same wait is allowed (and times out).
    assert!(matches!(
        channel.get_cq_event(Some(Duration::from_millis(10))),
        Err(Error::Timeout(_))
    ));
    drop(mr);

    // A thread that stays inside an entry point: a quiesce waits for it, at most its
    // bound, and names it; entries are refused meanwhile; after the quiesce ends they are
    // let in again.
    std::thread::scope(|s| {
        let stuck = std::thread::Builder::new()
            .name("stuck-in-reg-mr".into())
            .spawn_scoped(s, || pd.reg_mr(64, AccessFlags::NONE).map(drop))
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while !STUCK_INSIDE.load(Ordering::Acquire) {
            assert!(
                Instant::now() < deadline,
                "the thread never got inside reg_mr"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let t0 = Instant::now();
        match dev.quiesce(Duration::from_millis(50)) {
            Err(Error::StillInside(report)) => {
                let waited = t0.elapsed();
                println!("quiesce after {waited:?}: {report}");
                assert!(waited >= Duration::from_millis(50), "{waited:?}");
                assert_eq!(report.inside, 1, "{report}");
                assert_eq!(report.threads.len(), 1, "{report}");
                assert_eq!(report.threads[0].thread, "stuck-in-reg-mr");
                assert_eq!(report.threads[0].entry, "ProtectionDomain::reg_mr");
                assert!(report.threads[0].tid > 0);
            }
            other => panic!("quiesce with a thread inside: {other:?}"),
        }
        // The failed quiesce let the device go: a quiesce with a longer bound waits for the
        // thread, which leaves when released.
        let releaser = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            RELEASE_STUCK.store(true, Ordering::Release);
        });
        let q = dev.quiesce(WAIT).unwrap();
        stuck.join().unwrap().unwrap();
        releaser.join().unwrap();
        assert!(matches!(
            pd.reg_mr(64, AccessFlags::NONE),
            Err(Error::DeviceQuiesced)
        ));
        assert!(matches!(
            dev.quiesce(Duration::ZERO),
            Err(Error::DeviceQuiesced)
        ));
        q.end();
        assert!(dev.alloc_pd().is_ok());
    });
    drop(objects);
    *INSIDE_CHANNEL.lock().unwrap() = None;
}
