//! The client/server conversation of `softwarp bench` over the control channel.
//!
//! ```text
//! server -> client  HELLO rdma=PORT tcp=PORT
//! client -> server  SHAPE <spec> qps=N tcp=0|1 (one per shape)
//! server -> client  OK qps=N                    then, N times: accepts an iWARP connection
//! both              MR src= srck= dst= dstk=    (server first; for that QP)
//!                                               then N TCP baseline connections, if asked
//! client -> server  RUN which=sw|tcp size= iters=
//! server -> client  GO                          both run their part (on every QP at once)
//! server -> client  DONE cpu=SECONDS            the server saw everything
//! client -> server  FIN / BYE
//! ```
//!
//! Any failure is reported to the other side as `ERR why=...`, so neither hangs.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use hdrhistogram::Histogram;

use super::ctrl::{Ctrl, Msg, CTRL_TIMEOUT};
use super::rdma::{Ep, Role};
use super::spec::{Kind, Spec};
use super::tcp::{accept_timeout, Side};

/// One timed measurement.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timed {
    /// Wall-clock seconds.
    pub secs: f64,
    /// CPU seconds (user + system) of both ends over the run.
    pub cpu: f64,
    /// Latency runs: the distribution of the iterations' round trips.
    pub rtt: Option<Rtt>,
    /// Bandwidth runs: payload bytes the client's side moved as the active side, counted
    /// as they completed, added up over its QPs or TCP connections (0 for latency runs
    /// and for runs not timed by this crate's client).
    pub bytes: u64,
}

/// Round trips of the iterations of a latency run, in seconds (perftest's t_min, t_max,
/// t_typical, t_avg, t_stdev, 99% and 99.9% percentiles).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rtt {
    /// Fastest iteration.
    pub min: f64,
    /// Median iteration ("typical": robust against the odd preempted iteration).
    pub median: f64,
    /// Mean of the iterations.
    pub mean: f64,
    /// Standard deviation of the iterations.
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
    /// Slowest iteration.
    pub max: f64,
}

impl Rtt {
    /// Significant decimal digits the histogram keeps: every figure is within 0.1% of the
    /// exact one.
    const SIGNIFICANT_DIGITS: u8 = 3;

    /// The distribution of the round trips `ns` (nanoseconds), from an HDR histogram;
    /// `None` when there are none.
    pub fn of(ns: &[u64]) -> Option<Self> {
        if ns.is_empty() {
            return None;
        }
        // Auto-resizing: `record` grows it to any value (`saturating_record` would clamp
        // to the current top instead, so it is only the fallback should growing fail).
        let mut h = Histogram::<u64>::new(Self::SIGNIFICANT_DIGITS).ok()?;
        for &v in ns {
            if h.record(v).is_err() {
                h.saturating_record(v);
            }
        }
        let secs = |v: u64| v as f64 / 1e9;
        Some(Self {
            min: secs(h.min()),
            median: secs(h.value_at_quantile(0.5)),
            mean: h.mean() / 1e9,
            stdev: h.stdev() / 1e9,
            p99: secs(h.value_at_quantile(0.99)),
            p99_9: secs(h.value_at_quantile(0.999)),
            max: secs(h.max()),
        })
    }
}

/// Which stack a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// Softwarp (iWARP over TCP).
    Softwarp,
    /// The raw TCP baseline.
    Tcp,
}

impl Which {
    fn word(self) -> &'static str {
        match self {
            Which::Softwarp => "sw",
            Which::Tcp => "tcp",
        }
    }
}

/// The server's three listening sockets.
#[derive(Debug)]
pub struct Listeners {
    ctrl: TcpListener,
    rdma: softwarp::Listener,
    tcp: TcpListener,
}

impl Listeners {
    /// Binds the control listener on `port`, iWARP on `port + 1` and the TCP baseline on
    /// `port + 2` (port 0: three ephemeral ports).
    pub fn bind(ip: IpAddr, port: u16) -> Result<Self> {
        let next = |k: u16| if port == 0 { 0 } else { port.saturating_add(k) };
        Ok(Self {
            ctrl: TcpListener::bind((ip, port)).context("binding the control port")?,
            rdma: softwarp::Listener::bind((ip, next(1))).context("binding the iWARP port")?,
            tcp: TcpListener::bind((ip, next(2))).context("binding the TCP baseline port")?,
        })
    }

    /// The control address clients connect to.
    pub fn ctrl_addr(&self) -> Result<SocketAddr> {
        Ok(self.ctrl.local_addr()?)
    }

    /// The iWARP listener's port.
    pub fn rdma_port(&self) -> Result<u16> {
        Ok(self.rdma.local_addr()?.port())
    }

    /// The TCP baseline listener's port.
    pub fn tcp_port(&self) -> Result<u16> {
        Ok(self.tcp.local_addr()?.port())
    }
}

/// Serves one client session (every shape it asks for), then returns. `accept_timeout`
/// bounds the wait for the client (`None`: wait forever). `qps`: the server's own `-q`,
/// if it was given; a client asking for another QP count for a bandwidth shape is then
/// refused (otherwise the client's count is served).
pub fn serve(
    l: &Listeners,
    accept_timeout_ctrl: Option<Duration>,
    qps: Option<usize>,
) -> Result<()> {
    let stream = match accept_timeout_ctrl {
        Some(t) => accept_timeout(&l.ctrl, t)?,
        None => {
            l.ctrl
                .accept()
                .context("accepting the control connection")?
                .0
        }
    };
    let mut ctrl = Ctrl::new(stream)?;
    ctrl.send(
        &Msg::new("HELLO")
            .with("rdma", l.rdma.local_addr()?.port())
            .with("tcp", l.tcp.local_addr()?.port()),
    )?;
    loop {
        let m = ctrl.recv()?;
        match m.word.as_str() {
            "SHAPE" => {
                if let Err(e) = serve_shape(&mut ctrl, &m, l, qps) {
                    ctrl.send_err(&e);
                    return Err(e);
                }
            }
            "BYE" => return Ok(()),
            other => bail!("unexpected control message {other}"),
        }
    }
}

/// Runs `f` on every item, concurrently (one scoped thread each) when there are several
/// (`-q`), and adds up what they return. The first error wins.
fn each<T: Send>(items: &mut [T], f: impl Fn(&mut T) -> Result<u64> + Sync) -> Result<u64> {
    if let [one] = items {
        return f(one);
    }
    std::thread::scope(|s| {
        let f = &f;
        let threads: Vec<_> = items
            .iter_mut()
            .enumerate()
            .map(|(i, item)| {
                std::thread::Builder::new()
                    .name(format!("bench-qp{i}"))
                    .spawn_scoped(s, move || f(item))
            })
            .collect::<std::io::Result<_>>()?;
        let mut total = 0;
        let mut first_err = None;
        for t in threads {
            match t.join() {
                Ok(Ok(n)) => total += n,
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(anyhow!("a benchmark QP thread panicked"));
                }
            }
        }
        first_err.map_or(Ok(total), Err)
    })
}

fn serve_shape(ctrl: &mut Ctrl, m: &Msg, l: &Listeners, qps: Option<usize>) -> Result<()> {
    let spec = Spec::from_msg(m)?;
    let want_tcp = m.num::<u8>("tcp")? != 0;
    if let (Some(q), Kind::Bw) = (qps, spec.shape.kind) {
        ensure!(
            q == spec.qps,
            "mismatched -q: the client asks for {} QP(s) per shape ({}), this server was \
             started with -q {q} (give both ends the same -q, or none to the server)",
            spec.qps,
            spec.shape
        );
    }
    ensure!(
        (1..=MAX_QPS).contains(&spec.qps),
        "qps={} outside 1..={MAX_QPS}",
        spec.qps
    );
    let dev = softwarp::Device::open_default()?;
    let mut eps = (0..spec.qps)
        .map(|_| Ep::new(spec, &dev))
        .collect::<Result<Vec<_>>>()?;
    // OK carries the QP count back, so that a client asking for several QPs can tell
    // this server from one that predates -q (whose OK has no qps).
    ctrl.send(&Msg::new("OK").with("qps", spec.qps))?;
    // One QP at a time: the client connects the next only once this one is up, so the
    // i-th accepted connection is the client's i-th QP and the adverts pair up.
    for ep in &mut eps {
        ep.accept(&l.rdma)
            .context("accepting the benchmark connection")?;
        ctrl.send(&ep.advert())?;
        let peer = ctrl.recv()?.expect("MR")?;
        ep.set_peer(&peer)?;
    }
    let mut sides = Vec::new();
    if want_tcp {
        for _ in 0..spec.qps {
            sides.push(Side::new(spec, accept_timeout(&l.tcp, CTRL_TIMEOUT)?)?);
        }
    }
    loop {
        let m = ctrl.recv()?;
        match m.word.as_str() {
            "RUN" => {
                let size: usize = m.num("size")?;
                let iters: u64 = m.num("iters")?;
                let which = m.get("which")?;
                if which == "sw" {
                    for ep in &mut eps {
                        ep.prepare(size)?;
                    }
                }
                ctrl.send(&Msg::new("GO"))?;
                let cpu0 = super::cpu::process_cpu_secs();
                match which {
                    "sw" => each(&mut eps, |ep| ep.run(Role::Server, size, iters).map(|()| 0))?,
                    "tcp" if want_tcp => each(&mut sides, |s| s.run(false, size, iters))?,
                    _ => bail!("RUN which={which} is not available"),
                };
                let cpu = super::cpu::process_cpu_secs() - cpu0;
                ctrl.send(&Msg::new("DONE").with("cpu", format!("{cpu:.4}")))?;
            }
            "FIN" => break,
            other => bail!("unexpected control message {other}"),
        }
    }
    drop(sides);
    drop(eps);
    ctrl.send(&Msg::new("OK"))
}

/// The most QPs per shape (`-q`).
pub const MAX_QPS: usize = 64;

/// The client end of a session.
#[derive(Debug)]
pub struct Client {
    ctrl: Ctrl,
    rdma_addr: SocketAddr,
    tcp_addr: SocketAddr,
    /// The server runs in this process: its CPU time is already in ours.
    same_process: bool,
}

impl Client {
    /// Connects to the server's control port and reads its HELLO.
    pub fn connect(addr: SocketAddr, same_process: bool) -> Result<Self> {
        let deadline = Instant::now() + CTRL_TIMEOUT;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, CTRL_TIMEOUT) {
                Ok(s) => break s,
                // The server may still be starting (two-process use): retry until the
                // deadline.
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).with_context(|| format!("connecting to {addr}")),
            }
        };
        let mut ctrl = Ctrl::new(stream)?;
        let hello = ctrl.recv()?.expect("HELLO")?;
        let ip = addr.ip();
        Ok(Self {
            rdma_addr: SocketAddr::new(ip, hello.num("rdma")?),
            tcp_addr: SocketAddr::new(ip, hello.num("tcp")?),
            ctrl,
            same_process,
        })
    }

    /// Opens the connections of one shape (`spec.qps` QPs, and as many TCP connections
    /// with `tcp`) and hands them to `f`.
    pub fn shape(
        &mut self,
        spec: Spec,
        tcp: bool,
        f: impl FnOnce(&mut ShapeConn<'_>) -> Result<()>,
    ) -> Result<()> {
        let msg = spec.to_msg("SHAPE").with("tcp", u8::from(tcp));
        let ok = self.ctrl.call(&msg, "OK")?;
        // A server from before -q answers OK without qps and would serve one QP.
        let served: usize = if ok.get("qps").is_ok() {
            ok.num("qps")?
        } else {
            1
        };
        if served != spec.qps {
            let e = anyhow!(
                "the server serves {served} QP(s) per shape where -q asks for {}: it is a \
                 softwarp bench from before -q (upgrade it, or run without -q)",
                spec.qps
            );
            self.ctrl.send_err(&e);
            return Err(e);
        }
        let dev = softwarp::Device::open_default()?;
        let mut eps = Vec::with_capacity(spec.qps);
        for _ in 0..spec.qps {
            let mut ep = Ep::new(spec, &dev)?;
            ep.connect(self.rdma_addr)
                .context("connecting to the benchmark server")?;
            let peer = self.ctrl.recv()?.expect("MR")?;
            ep.set_peer(&peer)?;
            self.ctrl.send(&ep.advert())?;
            eps.push(ep);
        }
        let mut sides = Vec::new();
        if tcp {
            for _ in 0..spec.qps {
                let s = TcpStream::connect_timeout(&self.tcp_addr, CTRL_TIMEOUT)
                    .context("connecting the TCP baseline")?;
                sides.push(Side::new(spec, s)?);
            }
        }
        let mut conn = ShapeConn {
            ctrl: &mut self.ctrl,
            spec,
            eps,
            sides,
            same_process: self.same_process,
        };
        let r = f(&mut conn);
        if let Err(e) = &r {
            conn.ctrl.send_err(e);
            return r;
        }
        conn.sides.clear();
        self.ctrl.call(&Msg::new("FIN"), "OK")?;
        Ok(())
    }

    /// Ends the session.
    pub fn bye(mut self) -> Result<()> {
        self.ctrl.send(&Msg::new("BYE"))
    }
}

/// The connections of one shape, client side.
pub struct ShapeConn<'a> {
    ctrl: &'a mut Ctrl,
    spec: Spec,
    /// One endpoint per QP (`-q`).
    eps: Vec<Ep>,
    /// One raw TCP connection per QP (empty without the baseline).
    sides: Vec<Side>,
    same_process: bool,
}

impl ShapeConn<'_> {
    /// Times one run of `iters` operations of `size` bytes on `which`, on every QP (or
    /// TCP connection) at once: from the common start until the last one finished (for
    /// bandwidth: until the server saw every byte of every QP).
    pub fn run(&mut self, which: Which, size: usize, iters: u64) -> Result<Timed> {
        if which == Which::Softwarp {
            for ep in &mut self.eps {
                ep.prepare(size)?;
            }
        }
        if which == Which::Tcp && self.sides.is_empty() {
            bail!("no TCP baseline connection");
        }
        self.ctrl.call(
            &Msg::new("RUN")
                .with("which", which.word())
                .with("size", size)
                .with("iters", iters),
            "GO",
        )?;
        let cpu0 = super::cpu::process_cpu_secs();
        let t0 = Instant::now();
        let bytes = match which {
            Which::Softwarp => each(&mut self.eps, |ep| {
                let before = ep.completed();
                ep.run(Role::Client, size, iters)?;
                Ok((ep.completed() - before) * size as u64)
            })?,
            Which::Tcp => each(&mut self.sides, |s| s.run(true, size, iters))?,
        };
        let t_local = t0.elapsed();
        let done = self.ctrl.recv()?.expect("DONE")?;
        // Bandwidth ends when the server saw every byte; latency loops end here.
        let secs = match self.spec.shape.kind {
            Kind::Bw => t0.elapsed(),
            Kind::Lat => t_local,
        }
        .as_secs_f64();
        let mut cpu = super::cpu::process_cpu_secs() - cpu0;
        if !self.same_process {
            cpu += done.num::<f64>("cpu")?;
        }
        let rtt = match (self.spec.shape.kind, which) {
            (Kind::Bw, _) => None,
            // Latency shapes run on one QP (perftest has no -q for them).
            (Kind::Lat, Which::Softwarp) => self.eps.first().and_then(|e| Rtt::of(&e.samples)),
            (Kind::Lat, Which::Tcp) => self.sides.first().and_then(|s| Rtt::of(&s.samples)),
        };
        Ok(Timed {
            secs,
            cpu,
            rtt,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::{Mode, Shape};
    use super::*;

    #[test]
    fn a_server_from_before_qps_is_named_when_the_client_asks_for_several() {
        // An old server: its OK carries no qps (it would serve one QP).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let old = std::thread::spawn(move || -> Result<Msg> {
            let mut c = Ctrl::new(l.accept()?.0)?;
            c.send(&Msg::new("HELLO").with("rdma", 1).with("tcp", 2))?;
            let shape = c.recv()?.expect("SHAPE")?;
            assert_eq!(shape.num::<usize>("qps")?, 4);
            c.send(&Msg::new("OK"))?;
            // The client tells it why it goes away.
            c.recv()
        });
        let mut client = Client::connect(addr, false).unwrap();
        let spec = Spec {
            shape: Shape::ALL[0],
            max_size: 4096,
            depth: 16,
            bidir: false,
            crc: true,
            mode: Mode::Busy,
            fpdu: 0,
            alias_lead: true,
            post_list: 1,
            qps: 4,
        };
        let e = client
            .shape(spec, true, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("serves 1 QP(s) per shape where -q asks for 4") && e.contains("before -q"),
            "{e}"
        );
        let err = old.join().unwrap().unwrap();
        assert_eq!(err.word, "ERR");
    }
}
