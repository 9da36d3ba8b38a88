//! The client/server conversation of `softwarp bench` over the control channel.
//!
//! ```text
//! server -> client  HELLO rdma=PORT tcp=PORT
//! client -> server  SHAPE <spec> tcp=0|1       (one per shape)
//! server -> client  OK                          then accepts the iWARP connection
//! both              MR src= srck= dst= dstk=    (server first)
//!                                               then the TCP baseline connection, if asked
//! client -> server  RUN which=sw|tcp size= iters=
//! server -> client  GO                          both run their part
//! server -> client  DONE cpu=SECONDS            the server saw everything
//! client -> server  FIN / BYE
//! ```
//!
//! Any failure is reported to the other side as `ERR why=...`, so neither hangs.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
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
/// bounds the wait for the client (`None`: wait forever).
pub fn serve(l: &Listeners, accept_timeout_ctrl: Option<Duration>) -> Result<()> {
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
                if let Err(e) = serve_shape(&mut ctrl, &m, l) {
                    ctrl.send_err(&e);
                    return Err(e);
                }
            }
            "BYE" => return Ok(()),
            other => bail!("unexpected control message {other}"),
        }
    }
}

fn serve_shape(ctrl: &mut Ctrl, m: &Msg, l: &Listeners) -> Result<()> {
    let spec = Spec::from_msg(m)?;
    let want_tcp = m.num::<u8>("tcp")? != 0;
    let mut ep = Ep::new(spec)?;
    ctrl.send(&Msg::new("OK"))?;
    ep.accept(&l.rdma)
        .context("accepting the benchmark connection")?;
    ctrl.send(&ep.advert())?;
    let peer = ctrl.recv()?.expect("MR")?;
    ep.set_peer(&peer)?;
    let mut side = if want_tcp {
        Some(Side::new(spec, accept_timeout(&l.tcp, CTRL_TIMEOUT)?)?)
    } else {
        None
    };
    loop {
        let m = ctrl.recv()?;
        match m.word.as_str() {
            "RUN" => {
                let size: usize = m.num("size")?;
                let iters: u64 = m.num("iters")?;
                let which = m.get("which")?;
                if which == "sw" {
                    ep.prepare(size)?;
                }
                ctrl.send(&Msg::new("GO"))?;
                let cpu0 = super::cpu::process_cpu_secs();
                match (which, side.as_mut()) {
                    ("sw", _) => ep.run(Role::Server, size, iters)?,
                    ("tcp", Some(s)) => s.run(false, size, iters)?,
                    _ => bail!("RUN which={which} is not available"),
                }
                let cpu = super::cpu::process_cpu_secs() - cpu0;
                ctrl.send(&Msg::new("DONE").with("cpu", format!("{cpu:.4}")))?;
            }
            "FIN" => break,
            other => bail!("unexpected control message {other}"),
        }
    }
    drop(side);
    drop(ep);
    ctrl.send(&Msg::new("OK"))
}

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

    /// Opens the connections of one shape and hands them to `f`.
    pub fn shape(
        &mut self,
        spec: Spec,
        tcp: bool,
        f: impl FnOnce(&mut ShapeConn<'_>) -> Result<()>,
    ) -> Result<()> {
        let msg = spec.to_msg("SHAPE").with("tcp", u8::from(tcp));
        self.ctrl.call(&msg, "OK")?;
        let mut ep = Ep::new(spec)?;
        ep.connect(self.rdma_addr)
            .context("connecting to the benchmark server")?;
        let peer = self.ctrl.recv()?.expect("MR")?;
        ep.set_peer(&peer)?;
        self.ctrl.send(&ep.advert())?;
        let side = if tcp {
            let s = TcpStream::connect_timeout(&self.tcp_addr, CTRL_TIMEOUT)
                .context("connecting the TCP baseline")?;
            Some(Side::new(spec, s)?)
        } else {
            None
        };
        let mut conn = ShapeConn {
            ctrl: &mut self.ctrl,
            spec,
            ep,
            side,
            same_process: self.same_process,
        };
        let r = f(&mut conn);
        if let Err(e) = &r {
            conn.ctrl.send_err(e);
            return r;
        }
        drop(conn.side.take());
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
    ep: Ep,
    side: Option<Side>,
    same_process: bool,
}

impl ShapeConn<'_> {
    /// Times one run of `iters` operations of `size` bytes on `which`.
    pub fn run(&mut self, which: Which, size: usize, iters: u64) -> Result<Timed> {
        if which == Which::Softwarp {
            self.ep.prepare(size)?;
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
        match (which, self.side.as_mut()) {
            (Which::Softwarp, _) => self.ep.run(Role::Client, size, iters)?,
            (Which::Tcp, Some(s)) => s.run(true, size, iters)?,
            (Which::Tcp, None) => bail!("no TCP baseline connection"),
        }
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
        let rtt = match (self.spec.shape.kind, which, self.side.as_mut()) {
            (Kind::Bw, _, _) => None,
            (Kind::Lat, Which::Softwarp, _) => Rtt::of(&self.ep.samples),
            (Kind::Lat, Which::Tcp, Some(s)) => Rtt::of(&s.samples),
            (Kind::Lat, Which::Tcp, None) => None,
        };
        Ok(Timed { secs, cpu, rtt })
    }
}
