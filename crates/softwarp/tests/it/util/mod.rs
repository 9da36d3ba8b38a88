//! Test support: two connected endpoints over loopback TCP, each on its own device (own
//! progress thread and STag table), with bounded waits everywhere.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use softwarp::*;

/// Opts this test process in to the RAS services, as an application does, before the
/// first device opens: Softwarp's own `tracing` subscriber (console + flight recorder) and
/// the process-wide services as the environment configures them, with the runtime
/// directory (host registry, error log, automatic dumps) under the target directory unless
/// the test chose one itself: tests that inject device faults write automatic dumps, which
/// belong there and not in the host's `/run/softwarp`.
pub fn opt_in_ras() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("SOFTWARP_RUNTIME_DIR").is_none() {
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("softwarp-runtime");
            std::fs::create_dir_all(&dir).unwrap();
            std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);
        }
        let _ = softwarp_ras::trace::install_global();
        enable_ras(&RasConfig::from_env()).expect("SOFTWARP_RAS=off in the environment");
    });
}

/// Raises the soft limit on open files to `want` (within the hard limit); false when the
/// hard limit is lower.
pub fn raise_nofile(want: u64) -> bool {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let hard = lim.maximum.unwrap_or(u64::MAX);
    if hard < want {
        return false;
    }
    if lim.current.is_some_and(|c| c >= want) {
        return true;
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(want),
            maximum: lim.maximum,
        },
    )
    .is_ok()
}

/// Upper bound of every wait in the tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// One endpoint. Fields drop in declaration order: the device goes last, after everything
/// created from it (closing it earlier reports the rest as leaked).
pub struct End {
    pub qp: QueuePair,
    pub scq: CompletionQueue,
    pub rcq: CompletionQueue,
    pub pd: ProtectionDomain,
    pub info: Option<ConnectionInfo>,
    pub dev: Device,
}

impl End {
    pub fn new(channel: Option<&CompletionChannel>, dev: Option<Device>) -> Self {
        Self::with(channel, dev, |_| {})
    }

    pub fn with(
        channel: Option<&CompletionChannel>,
        dev: Option<Device>,
        tweak: impl FnOnce(&mut QpInitAttr<'_>),
    ) -> Self {
        Self::with_cqe(channel, dev, 1024, tweak)
    }

    /// As [`End::with`], with CQs of `cqe` entries (not 1024).
    pub fn with_cqe(
        channel: Option<&CompletionChannel>,
        dev: Option<Device>,
        cqe: usize,
        tweak: impl FnOnce(&mut QpInitAttr<'_>),
    ) -> Self {
        opt_in_ras();
        let dev = dev.unwrap_or_else(|| Device::open_default().unwrap());
        let pd = dev.alloc_pd().unwrap();
        let scq = dev.create_cq(cqe, channel).unwrap();
        let rcq = dev.create_cq(cqe, channel).unwrap();
        let mut attr = QpInitAttr::new(&scq, &rcq);
        tweak(&mut attr);
        let qp = pd.create_qp(&attr).unwrap();
        Self {
            dev,
            pd,
            scq,
            rcq,
            qp,
            info: None,
        }
    }

    /// Registers `len` bytes with `access`, filled with a pattern from `seed`.
    pub fn mr(&self, len: usize, access: AccessFlags, seed: u64) -> (MemoryRegion, Vec<u8>) {
        let mr = self.pd.reg_mr(len, access).unwrap();
        let data = pattern(len, seed);
        mr.write_at(0, &data).unwrap();
        (mr, data)
    }
}

/// Connects `client` to `server` over loopback with `opts` (server posts before).
pub fn connect(client: &mut End, server: &mut End, opts: &ConnectOptions) {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (ci, si) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept_timeout(&server.qp, opts, WAIT).unwrap());
        let ci = client.qp.connect(addr, opts).unwrap();
        (ci, h.join().unwrap())
    });
    client.info = Some(ci);
    server.info = Some(si);
}

/// A connected pair: `a` initiated, `b` accepted.
pub fn pair(opts: &ConnectOptions) -> (End, End) {
    let mut a = End::new(None, None);
    let mut b = End::new(None, None);
    connect(&mut a, &mut b, opts);
    (a, b)
}

/// Deterministic pattern bytes (xorshift64*, 8 bytes per step).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Polls `cq` until `n` completions arrived (panics after [`WAIT`]).
pub fn wait_wcs(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut buf = [EMPTY_COMPLETION; 16];
    while out.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} completions, got {out:?}"
            );
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    out
}

/// Asserts that no completion arrives on `cq` within `d`.
pub fn assert_no_wc(cq: &CompletionQueue, d: Duration) {
    std::thread::sleep(d);
    assert_eq!(cq.poll_one(), None);
}

/// Waits for an async event matching `pred` on `dev` (other events are collected).
pub fn wait_event(
    dev: &Device,
    pred: impl Fn(&AsyncEvent) -> bool,
) -> (AsyncEvent, Vec<AsyncEvent>) {
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match dev.get_async_event_timeout(left) {
            Ok(ev) if pred(&ev) => return (ev, seen),
            Ok(ev) => seen.push(ev),
            Err(_) => panic!("timed out waiting for an async event; saw {seen:?}"),
        }
    }
}

/// Waits until the QP reaches `state`.
pub fn wait_state(qp: &QueuePair, state: QpState) {
    let deadline = Instant::now() + WAIT;
    while qp.state() != state {
        assert!(
            Instant::now() < deadline,
            "QP {} stuck in {:?}, expected {state:?}",
            qp.qp_num(),
            qp.state()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Splits `len` bytes at `offset` of `mr` into `parts` SGEs of uneven sizes.
pub fn sgl(mr: &MemoryRegion, offset: usize, len: usize, parts: usize) -> SgList {
    let mut l = SgList::new();
    if len == 0 {
        return l;
    }
    let parts = parts.clamp(1, MAX_SGE).min(len);
    let mut off = offset;
    let mut left = len;
    for i in 0..parts {
        let take = if i + 1 == parts {
            left
        } else {
            // Uneven: the first pieces take a third of what is left (at least 1 byte).
            (left / 3).max(1).min(left - (parts - i - 1))
        };
        l.push(mr.sge(off, take as u32).unwrap()).unwrap();
        off += take;
        left -= take;
    }
    l
}

pub fn send_wr(wr_id: u64, op: SendOp, payload: Payload<'_>) -> SendWr<'_> {
    SendWr {
        wr_id,
        op,
        payload,
        signaled: true,
        fence: false,
    }
}

pub fn send_op(solicited: bool, invalidate: Option<Stag>) -> SendOp {
    SendOp::Send {
        solicited,
        invalidate,
    }
}

pub const SIZES: [usize; 5] = [0, 1, 4095, 1 << 20, 16 << 20];

/// A detail of `e`'s QP in the RAS resources.
pub fn qp_detail(e: &End, key: &str) -> Option<String> {
    softwarp_ras::tracker::all_resources()
        .into_iter()
        .filter(|r| {
            r.tracker == e.dev.instance_name() && r.kind == softwarp_ras::tracker::ResourceKind::Qp
        })
        .find_map(|r| r.details.and_then(|d| d.attrs.get(key).cloned()))
}
