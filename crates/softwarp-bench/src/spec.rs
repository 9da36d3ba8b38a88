//! What a benchmark measures: the six perftest shapes, the waiting modes, and the
//! parameters the client sends to the server over the control channel.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Result};

use super::ctrl::Msg;

/// The operation of a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Send / Receive.
    Send,
    /// RDMA Write.
    Write,
    /// RDMA Read.
    Read,
}

/// Bandwidth (a window of outstanding operations) or latency (one at a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Streaming bandwidth and message rate (perftest `ib_*_bw`).
    Bw,
    /// Latency (perftest `ib_*_lat`).
    Lat,
}

/// One of perftest's six shapes (`send_bw` ... `read_lat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// The operation.
    pub op: Op,
    /// Bandwidth or latency.
    pub kind: Kind,
}

impl Shape {
    /// The six shapes, in the order `all` runs them.
    pub const ALL: [Shape; 6] = [
        Shape::new(Op::Write, Kind::Bw),
        Shape::new(Op::Send, Kind::Bw),
        Shape::new(Op::Read, Kind::Bw),
        Shape::new(Op::Write, Kind::Lat),
        Shape::new(Op::Send, Kind::Lat),
        Shape::new(Op::Read, Kind::Lat),
    ];

    const fn new(op: Op, kind: Kind) -> Self {
        Self { op, kind }
    }

    /// perftest's name without the `ib_` prefix, e.g. `write_bw`.
    pub fn name(self) -> &'static str {
        match (self.op, self.kind) {
            (Op::Send, Kind::Bw) => "send_bw",
            (Op::Write, Kind::Bw) => "write_bw",
            (Op::Read, Kind::Bw) => "read_bw",
            (Op::Send, Kind::Lat) => "send_lat",
            (Op::Write, Kind::Lat) => "write_lat",
            (Op::Read, Kind::Lat) => "read_lat",
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Shape {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().trim_start_matches("ib_");
        for sh in Shape::ALL {
            if sh.name() == s {
                return Ok(sh);
            }
        }
        bail!(
            "unknown shape {s:?} (send_bw, write_bw, read_bw, send_lat, write_lat, read_lat, all)"
        )
    }
}

/// How a waiting side learns about completions.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Busy polling: the application thread spins on its CQ, and polling the CQ also moves
    /// the QP's received bytes (no thread wake-up on the data path). Raw TCP: non-blocking
    /// sockets polled in a loop.
    Busy,
    /// The application thread spins on its CQ while the device's progress thread (woken by
    /// epoll) moves the bytes. Raw TCP: as `busy`.
    Spin,
    /// Completion channel: the application thread sleeps until a completion event. Raw
    /// TCP: blocking system calls.
    Event,
}

impl Mode {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Busy => "busy",
            Mode::Spin => "spin",
            Mode::Event => "event",
        }
    }
    /// True when raw TCP sockets should be polled (non-blocking) rather than block.
    pub fn tcp_polls(self) -> bool {
        self != Mode::Event
    }
}

impl FromStr for Mode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "busy" => Ok(Mode::Busy),
            "spin" => Ok(Mode::Spin),
            "event" => Ok(Mode::Event),
            _ => bail!("unknown mode {s:?}"),
        }
    }
}

/// Parameters of one connection (one shape, every size), as the client sends them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// The shape.
    pub shape: Shape,
    /// Largest message size of the run (buffers are this large).
    pub max_size: usize,
    /// Outstanding operations (bandwidth shapes).
    pub depth: usize,
    /// Both directions at once.
    pub bidir: bool,
    /// CRC32c on the FPDUs.
    pub crc: bool,
    /// Waiting mode.
    pub mode: Mode,
    /// Largest FPDU (0: the connection's default: the TCP MSS, 65,535 bytes to this host).
    pub fpdu: usize,
    /// Short FPDUs lead a large message whose payload would hit 4 KiB aliasing in the
    /// kernel's copy (`ConnectOptions::tx_alias_lead`; `--no-alias-lead` turns it off).
    pub alias_lead: bool,
    /// Work requests posted per list (perftest `--post_list`).
    pub post_list: usize,
    /// QPs (and raw TCP connections) between the two ends, each running the shape's
    /// loop concurrently (perftest `-q`; bandwidth shapes only).
    pub qps: usize,
}

impl Spec {
    /// The control message that carries the spec.
    pub fn to_msg(self, word: &str) -> Msg {
        Msg::new(word)
            .with("shape", self.shape)
            .with("max", self.max_size)
            .with("depth", self.depth)
            .with("bidir", u8::from(self.bidir))
            .with("crc", u8::from(self.crc))
            .with("mode", self.mode.name())
            .with("fpdu", self.fpdu)
            .with("lead", u8::from(self.alias_lead))
            .with("list", self.post_list)
            .with("qps", self.qps)
    }

    /// Reads a spec back from its control message.
    pub fn from_msg(m: &Msg) -> Result<Self> {
        Ok(Self {
            shape: m.get("shape")?.parse()?,
            max_size: m.num("max")?,
            depth: m.num::<usize>("depth")?.max(1),
            bidir: m.num::<u8>("bidir")? != 0,
            crc: m.num::<u8>("crc")? != 0,
            mode: m.get("mode")?.parse()?,
            fpdu: m.num("fpdu")?,
            // A client from before the option: on, as its library did not have it.
            alias_lead: m.get("lead").is_err() || m.num::<u8>("lead")? != 0,
            post_list: m.num::<usize>("list")?.max(1),
            // A client from before -q sends no qps: one QP.
            qps: if m.get("qps").is_ok() {
                m.num::<usize>("qps")?.max(1)
            } else {
                1
            },
        })
    }

    /// Receive work requests each side keeps posted for the peer's data Sends (send_bw):
    /// the credit window. The peer returns credits in batches of a quarter of it.
    pub fn data_receives(self) -> usize {
        match (self.shape.op, self.shape.kind) {
            (Op::Send, Kind::Bw) => (self.depth * 4).clamp(64, 2048),
            _ => 0,
        }
    }

    /// Receives per credit message (send_bw).
    pub fn credit_batch(self) -> usize {
        (self.data_receives() / 4).max(1)
    }
}

/// Parses a size: a number with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().map_err(|e| format!("bad size {s:?}: {e}"))?;
    n.checked_mul(mul)
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Prints a size the way the sizes were given: 64, 4K, 8M.
pub fn fmt_size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_name_parses_back_with_or_without_the_ib_prefix() {
        for sh in Shape::ALL {
            assert_eq!(sh.name().parse::<Shape>().unwrap(), sh);
            assert_eq!(format!("ib_{sh}").parse::<Shape>().unwrap(), sh);
        }
        assert!("write".parse::<Shape>().is_err());
    }

    #[test]
    fn a_spec_survives_the_control_channel() {
        let s = Spec {
            shape: Shape::ALL[4],
            max_size: 8 << 20,
            depth: 64,
            bidir: true,
            crc: false,
            mode: Mode::Event,
            fpdu: 1448,
            alias_lead: false,
            post_list: 16,
            qps: 4,
        };
        assert_eq!(Spec::from_msg(&s.to_msg("RDMA")).unwrap(), s);
        // A SHAPE of a client from before -q: one QP.
        let old = Msg::parse(
            "SHAPE bidir=0 crc=1 depth=128 fpdu=0 list=1 max=65536 mode=busy shape=write_bw",
        )
        .unwrap();
        assert_eq!(Spec::from_msg(&old).unwrap().qps, 1);
    }

    #[test]
    fn sizes_take_binary_suffixes_and_print_back_the_same_way() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("8m").unwrap(), 8 << 20);
        assert_eq!(parse_size("3").unwrap(), 3);
        assert!(parse_size("5G").is_err());
        assert!(parse_size("x").is_err());
        assert_eq!(fmt_size(65536), "64K");
        assert_eq!(fmt_size(8 << 20), "8M");
        assert_eq!(fmt_size(1000), "1000");
    }
}
