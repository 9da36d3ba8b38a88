//! TCP_INFO of a connected socket (Linux `struct tcp_info`): round-trip time and its
//! variance, retransmissions, congestion window, bytes acknowledged. The raw bytes are
//! decoded by offset from `linux/tcp.h` (native byte order), so a kernel that returns a
//! shorter structure just leaves the newer fields `None`; no `unsafe` transmute.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::StatsBuilder;
use crate::sys;

/// Byte offsets of the fields used, from `struct tcp_info` in `include/uapi/linux/tcp.h`.
mod field {
    pub const STATE: usize = 0;
    pub const CA_STATE: usize = 1;
    pub const RETRANSMITS: usize = 2;
    pub const RTO: usize = 8;
    pub const SND_MSS: usize = 16;
    pub const RCV_MSS: usize = 20;
    pub const UNACKED: usize = 24;
    pub const LOST: usize = 32;
    pub const PMTU: usize = 60;
    pub const RTT: usize = 68;
    pub const RTTVAR: usize = 72;
    pub const SND_SSTHRESH: usize = 76;
    pub const SND_CWND: usize = 80;
    pub const TOTAL_RETRANS: usize = 100;
    /// End of the fields every supported kernel (3.x and later) fills.
    pub const BASE_END: usize = 104;
    pub const BYTES_ACKED: usize = 120;
    pub const BYTES_RECEIVED: usize = 128;
    pub const NOTSENT_BYTES: usize = 144;
    pub const MIN_RTT: usize = 148;
    pub const DELIVERY_RATE: usize = 160;
    pub const BYTES_SENT: usize = 200;
    pub const BYTES_RETRANS: usize = 208;
    /// Bytes requested from the kernel (it fills at most its own structure's size).
    pub const REQUEST: usize = 256;
}

/// What TCP_INFO says about a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpInfo {
    /// TCP state (`TCP_ESTABLISHED` = 1 ... as in `linux/tcp.h`).
    pub state: u8,
    /// Congestion-avoidance state (0 open, 1 disorder, 2 CWR, 3 recovery, 4 loss).
    pub ca_state: u8,
    /// Consecutive retransmissions of the oldest unacknowledged segment (timeouts).
    pub retransmits: u8,
    /// Retransmission timeout, microseconds.
    pub rto_us: u32,
    /// Smoothed round-trip time, microseconds.
    pub rtt_us: u32,
    /// Round-trip time variance, microseconds.
    pub rttvar_us: u32,
    /// Send MSS, bytes.
    pub snd_mss: u32,
    /// Receive MSS estimate, bytes.
    pub rcv_mss: u32,
    /// Path MTU, bytes.
    pub pmtu: u32,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
    /// Slow-start threshold, segments.
    pub snd_ssthresh: u32,
    /// Segments sent and not yet acknowledged.
    pub unacked: u32,
    /// Segments considered lost.
    pub lost: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// Bytes acknowledged by the peer (Linux 4.1+).
    pub bytes_acked: Option<u64>,
    /// Bytes received (Linux 4.1+).
    pub bytes_received: Option<u64>,
    /// Bytes queued and not yet sent (Linux 4.6+).
    pub notsent_bytes: Option<u32>,
    /// Minimum round-trip time seen, microseconds (Linux 4.6+).
    pub min_rtt_us: Option<u32>,
    /// Delivery rate estimate, bytes per second (Linux 4.9+).
    pub delivery_rate: Option<u64>,
    /// Bytes sent, retransmissions included (Linux 4.19+).
    pub bytes_sent: Option<u64>,
    /// Bytes retransmitted (Linux 4.19+).
    pub bytes_retrans: Option<u64>,
}

fn u8_at(b: &[u8], at: usize) -> Option<u8> {
    b.get(at).copied()
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_ne_bytes(bytes))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_ne_bytes(bytes))
}

impl TcpInfo {
    /// Decodes the bytes the kernel filled. `None` when shorter than the fields every
    /// kernel fills (104 bytes).
    pub fn parse(raw: &[u8]) -> Option<TcpInfo> {
        use field::*;
        if raw.len() < BASE_END {
            return None;
        }
        Some(TcpInfo {
            state: u8_at(raw, STATE)?,
            ca_state: u8_at(raw, CA_STATE)?,
            retransmits: u8_at(raw, RETRANSMITS)?,
            rto_us: u32_at(raw, RTO)?,
            rtt_us: u32_at(raw, RTT)?,
            rttvar_us: u32_at(raw, RTTVAR)?,
            snd_mss: u32_at(raw, SND_MSS)?,
            rcv_mss: u32_at(raw, RCV_MSS)?,
            pmtu: u32_at(raw, PMTU)?,
            snd_cwnd: u32_at(raw, SND_CWND)?,
            snd_ssthresh: u32_at(raw, SND_SSTHRESH)?,
            unacked: u32_at(raw, UNACKED)?,
            lost: u32_at(raw, LOST)?,
            total_retrans: u32_at(raw, TOTAL_RETRANS)?,
            bytes_acked: u64_at(raw, BYTES_ACKED),
            bytes_received: u64_at(raw, BYTES_RECEIVED),
            notsent_bytes: u32_at(raw, NOTSENT_BYTES),
            min_rtt_us: u32_at(raw, MIN_RTT),
            delivery_rate: u64_at(raw, DELIVERY_RATE),
            bytes_sent: u64_at(raw, BYTES_SENT),
            bytes_retrans: u64_at(raw, BYTES_RETRANS),
        })
    }

    /// Smoothed round-trip time.
    pub fn rtt(&self) -> Duration {
        Duration::from_micros(u64::from(self.rtt_us))
    }

    /// Round-trip time variance.
    pub fn rttvar(&self) -> Duration {
        Duration::from_micros(u64::from(self.rttvar_us))
    }

    /// Adds the values as `softwarp_tcp_*` metrics with `labels` (e.g. device and QP):
    /// times in seconds as gauges, byte and retransmission totals as counters.
    pub fn collect_into(&self, b: &mut StatsBuilder, labels: &[(&str, &str)]) {
        b.gauge(
            "softwarp_tcp_rtt_seconds",
            "Smoothed TCP round-trip time (TCP_INFO tcpi_rtt).",
            labels,
            self.rtt().as_secs_f64(),
        );
        b.gauge(
            "softwarp_tcp_rttvar_seconds",
            "TCP round-trip time variance (TCP_INFO tcpi_rttvar).",
            labels,
            self.rttvar().as_secs_f64(),
        );
        b.gauge_int(
            "softwarp_tcp_cwnd_segments",
            "TCP congestion window in segments (TCP_INFO tcpi_snd_cwnd).",
            labels,
            u64::from(self.snd_cwnd),
        );
        b.gauge_int(
            "softwarp_tcp_retransmits",
            "Consecutive retransmission timeouts of the oldest segment (TCP_INFO tcpi_retransmits).",
            labels,
            u64::from(self.retransmits),
        );
        b.counter(
            "softwarp_tcp_retransmitted_segments_total",
            "TCP segments retransmitted (TCP_INFO tcpi_total_retrans).",
            labels,
            u64::from(self.total_retrans),
        );
        if let Some(v) = self.bytes_acked {
            b.counter(
                "softwarp_tcp_acked_bytes_total",
                "Bytes acknowledged by the peer (TCP_INFO tcpi_bytes_acked).",
                labels,
                v,
            );
        }
        if let Some(v) = self.bytes_received {
            b.counter(
                "softwarp_tcp_received_bytes_total",
                "Bytes received (TCP_INFO tcpi_bytes_received).",
                labels,
                v,
            );
        }
    }
}

/// Reads TCP_INFO of the TCP socket `fd`.
pub fn tcp_info(fd: BorrowedFd<'_>) -> io::Result<TcpInfo> {
    let mut raw = [0u8; field::REQUEST];
    let n = sys::tcp_info_raw(fd, &mut raw)?;
    TcpInfo::parse(raw.get(..n).unwrap_or(&[])).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "TCP_INFO returned {n} bytes, fewer than {}",
                field::BASE_END
            ),
        )
    })
}

/// Samples TCP_INFO at most once per interval: the runtime calls [`TcpInfoSampler::poll`]
/// from its progress loop (time passed in, no thread of its own) and keeps the latest
/// sample for statistics and snapshots.
#[derive(Debug, Clone)]
pub struct TcpInfoSampler {
    interval: Duration,
    last_at: Option<Instant>,
    last: Option<TcpInfo>,
}

/// Environment variable with the TCP_INFO sampling interval in milliseconds.
pub const TCP_INFO_INTERVAL_ENV: &str = "SOFTWARP_TCP_INFO_INTERVAL_MS";
/// Sampling interval unless configured otherwise.
pub const DEFAULT_TCP_INFO_INTERVAL: Duration = Duration::from_secs(1);

impl TcpInfoSampler {
    /// The interval configured by `SOFTWARP_TCP_INFO_INTERVAL_MS`, else
    /// [`DEFAULT_TCP_INFO_INTERVAL`].
    pub fn interval_from_env() -> Duration {
        std::env::var(TCP_INFO_INTERVAL_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_TCP_INFO_INTERVAL, Duration::from_millis)
    }

    /// A sampler taking one sample per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last_at: None,
            last: None,
        }
    }

    /// The interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Changes the interval (takes effect at the next poll).
    pub fn set_interval(&mut self, interval: Duration) {
        self.interval = interval;
    }

    /// Whether a sample is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.last_at
            .is_none_or(|t| now.saturating_duration_since(t) >= self.interval)
    }

    /// Samples `fd` if due at `now`; returns the new sample, `None` when not due. A failed
    /// read is returned and not retried before the next interval.
    pub fn poll(&mut self, now: Instant, fd: BorrowedFd<'_>) -> Option<io::Result<TcpInfo>> {
        if !self.due(now) {
            return None;
        }
        self.last_at = Some(now);
        let r = tcp_info(fd);
        if let Ok(info) = &r {
            self.last = Some(*info);
        }
        Some(r)
    }

    /// The latest successful sample.
    pub fn last(&self) -> Option<&TcpInfo> {
        self.last.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    fn put32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }

    #[test]
    fn fields_decode_from_their_linux_offsets() {
        let mut raw = [0u8; 232];
        raw[0] = 1; // TCP_ESTABLISHED
        raw[1] = 4;
        raw[2] = 3;
        put32(&mut raw, 8, 204_000);
        put32(&mut raw, 16, 1448);
        put32(&mut raw, 60, 1500);
        put32(&mut raw, 68, 1234);
        put32(&mut raw, 72, 567);
        put32(&mut raw, 80, 10);
        put32(&mut raw, 100, 42);
        put64(&mut raw, 120, 1 << 33);
        put64(&mut raw, 128, 99);
        put32(&mut raw, 148, 800);
        put64(&mut raw, 208, 7);
        let t = TcpInfo::parse(&raw).unwrap();
        assert_eq!((t.state, t.ca_state, t.retransmits), (1, 4, 3));
        assert_eq!((t.rto_us, t.snd_mss, t.pmtu), (204_000, 1448, 1500));
        assert_eq!(t.rtt(), Duration::from_micros(1234));
        assert_eq!(t.rttvar(), Duration::from_micros(567));
        assert_eq!((t.snd_cwnd, t.total_retrans), (10, 42));
        assert_eq!(t.bytes_acked, Some(1 << 33));
        assert_eq!(t.bytes_received, Some(99));
        assert_eq!(t.min_rtt_us, Some(800));
        assert_eq!(t.bytes_retrans, Some(7));
    }

    #[test]
    fn an_old_kernels_short_structure_leaves_new_fields_empty() {
        let raw = [0u8; 104];
        let t = TcpInfo::parse(&raw).unwrap();
        assert_eq!(t.bytes_acked, None);
        assert_eq!(t.bytes_retrans, None);
        for n in 0..104 {
            assert_eq!(TcpInfo::parse(&raw[..n]), None, "length {n}");
        }
    }

    #[test]
    fn a_loopback_connection_reports_rtt_and_acked_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let data = [7u8; 100_000];
        c.write_all(&data).unwrap();
        let mut got = vec![0u8; data.len()];
        s.read_exact(&mut got).unwrap();
        // Acknowledgements of the last bytes may still be in flight: bounded wait.
        let deadline = Instant::now() + Duration::from_secs(5);
        let info = loop {
            let info = tcp_info(c.as_fd()).unwrap();
            if info.bytes_acked.unwrap_or(0) >= data.len() as u64 || Instant::now() > deadline {
                break info;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(info.state, 1, "established");
        assert!(info.rtt_us > 0);
        assert!(info.snd_cwnd > 0);
        assert!(info.bytes_acked.unwrap() >= data.len() as u64);
        let mut b = StatsBuilder::new();
        info.collect_into(&mut b, &[("qpn", "1")]);
        let snap = b.finish();
        assert!(snap
            .get("softwarp_tcp_rtt_seconds", &[("qpn", "1")])
            .is_some());
        assert!(snap
            .get("softwarp_tcp_acked_bytes_total", &[("qpn", "1")])
            .is_some());
    }

    #[test]
    fn tcp_info_of_a_non_tcp_socket_is_an_error() {
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(tcp_info(u.as_fd()).is_err());
    }

    #[test]
    fn the_sampler_samples_once_per_interval() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _s = l.accept().unwrap();
        let mut s = TcpInfoSampler::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert!(s.poll(t0, c.as_fd()).unwrap().is_ok());
        assert!(s.poll(t0 + Duration::from_millis(999), c.as_fd()).is_none());
        assert!(s.poll(t0 + Duration::from_secs(1), c.as_fd()).is_some());
        assert!(s.last().is_some());
        s.set_interval(Duration::from_secs(10));
        assert!(!s.due(t0 + Duration::from_secs(5)));
    }
}
