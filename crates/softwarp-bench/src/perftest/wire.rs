//! The messages of perftest's `-R` exchange (perftest 4.5, version string "6.06", as Debian
//! bookworm ships it), as bytes. Every one travels as the payload of one RDMAP Send on the
//! control QP; the receiver's buffer is `sizeof(struct pingpong_dest)` (56 bytes), so no
//! message is longer. No I/O here: encoders return bytes, decoders take the payload of one
//! receive completion and answer a typed error for anything perftest would not have sent.
//!
//! | message | bytes | layout |
//! | --- | --- | --- |
//! | version | 16 | ASCII, NUL-padded (`"6.06"`) |
//! | cycle buffer, cache line size | 4 each | big-endian `int` |
//! | MTU | 2 | one ASCII digit (the `ibv_mtu` enum, 1..=5) and a NUL |
//! | destination (`struct pingpong_dest`) | 56 | big-endian: LID, out_reads, QPN, PSN, rkey (u32 each), 4 bytes of padding, vaddr (u64), GID (16 raw bytes), SRQN, GID index (u32 each) |
//! | report fields | 8 each | big-endian u64 (size, iterations) or the big-endian bit pattern of an IEEE double (peak and average MB/s, million messages per second) |
//!
//! The credits of `ib_send_bw` over iWARP are not Sends: the receiver RDMA Writes its count
//! of received messages, a little-endian (host order) u32, into the sender's credit word.

use thiserror::Error;

/// Length of `struct pingpong_dest` on the wire (and of perftest's control receive buffer).
pub const DEST_LEN: usize = 56;
/// Length of the version message.
pub const VERSION_LEN: usize = 16;
/// The version this implementation announces: perftest 4.5's.
pub const OUR_VERSION: &str = "6.06";
/// The oldest peer version whose message formats this module implements: from 5.33 on the
/// report's iteration count is 8 bytes, the MTU 2 and the cycle buffer and cache line
/// size are exchanged.
pub const MIN_PEER_VERSION: f64 = 5.33;

/// A message of the exchange that perftest would not have sent.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// The message has the wrong length for its place in the exchange.
    #[error("perftest {what}: {got} bytes, expected {want}")]
    Length {
        /// Which message.
        what: &'static str,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// The version string is not a NUL-padded "major.minor".
    #[error("perftest version: not a version string ({0:?})")]
    BadVersion(Vec<u8>),
    /// The peer's version predates the formats implemented here.
    #[error("perftest version {0} is older than {MIN_PEER_VERSION}: its exchange formats differ")]
    OldVersion(String),
    /// A size field (cycle buffer, cache line) is zero, negative or absurd.
    #[error("perftest {what}: {value} is not a plausible size")]
    BadSize {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: i64,
    },
    /// The MTU message is not one ASCII digit for 256..4096 bytes and a NUL.
    #[error("perftest MTU: {0:02x?} is not an ibv_mtu digit")]
    BadMtu(Vec<u8>),
}

fn exact<'a, const N: usize>(
    what: &'static str,
    b: &'a [u8],
) -> Result<&'a [u8; N], ExchangeError> {
    b.try_into().map_err(|_| ExchangeError::Length {
        what,
        got: b.len(),
        want: N,
    })
}

/// A peer's version ("6.06"): the string and its number.
#[derive(Debug, Clone, PartialEq)]
pub struct Version {
    /// As sent, without the padding.
    pub text: String,
    /// As perftest reads it (`atof`).
    pub number: f64,
}

/// The version message for `v` (at most 15 characters).
pub fn encode_version(v: &str) -> [u8; VERSION_LEN] {
    let mut b = [0u8; VERSION_LEN];
    for (d, s) in b.iter_mut().zip(v.bytes().take(VERSION_LEN - 1)) {
        *d = s;
    }
    b
}

/// Parses a version message and checks that its formats are the ones implemented here.
pub fn decode_version(b: &[u8]) -> Result<Version, ExchangeError> {
    let b = exact::<VERSION_LEN>("version", b)?;
    let end = b.iter().position(|&c| c == 0).unwrap_or(VERSION_LEN);
    let (text, pad) = b.split_at(end);
    let bad = || ExchangeError::BadVersion(b.to_vec());
    if text.is_empty()
        || !text.iter().all(|c| c.is_ascii_digit() || *c == b'.')
        || pad.iter().any(|&c| c != 0)
    {
        return Err(bad());
    }
    let text = String::from_utf8(text.to_vec()).map_err(|_| bad())?;
    let number: f64 = text.parse().map_err(|_| bad())?;
    if number < MIN_PEER_VERSION {
        return Err(ExchangeError::OldVersion(text));
    }
    Ok(Version { text, number })
}

/// A 4-byte size field (cycle buffer, cache line size): big-endian `int`.
pub fn encode_size(v: u32) -> [u8; 4] {
    v.to_be_bytes()
}

/// Parses a 4-byte size field; `what` names it, `max` bounds it.
pub fn decode_size(what: &'static str, b: &[u8], max: u32) -> Result<u32, ExchangeError> {
    let v = i32::from_be_bytes(*exact::<4>(what, b)?);
    match u32::try_from(v) {
        Ok(v) if v >= 1 && v <= max => Ok(v),
        _ => Err(ExchangeError::BadSize {
            what,
            value: i64::from(v),
        }),
    }
}

/// The MTU message for `ibv_mtu` value `mtu` (1 = 256 B ... 5 = 4096 B).
pub fn encode_mtu(mtu: u8) -> [u8; 2] {
    [b'0' + mtu.clamp(1, 5), 0]
}

/// Parses the MTU message into the `ibv_mtu` value.
pub fn decode_mtu(b: &[u8]) -> Result<u8, ExchangeError> {
    let b = exact::<2>("MTU", b)?;
    match *b {
        [d @ b'1'..=b'5', 0] => Ok(d - b'0'),
        _ => Err(ExchangeError::BadMtu(b.to_vec())),
    }
}

/// `struct pingpong_dest`: what each side tells the other about a QP and its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dest {
    /// InfiniBand LID (0 on iWARP).
    pub lid: u32,
    /// RDMA Reads this side lets the other have outstanding.
    pub out_reads: u32,
    /// QP number.
    pub qpn: u32,
    /// Initial packet sequence number (unused by iWARP).
    pub psn: u32,
    /// STag of the buffer the peer may access (`ib_send_bw`: of the credit word).
    pub rkey: u32,
    /// Its address.
    pub vaddr: u64,
    /// The port's GID.
    pub gid: [u8; 16],
    /// SRQ number (XRC and DC only).
    pub srqn: u32,
    /// GID index.
    pub gid_index: u32,
}

mod field {
    use std::ops::Range;
    pub const LID: Range<usize> = 0..4;
    pub const OUT_READS: Range<usize> = 4..8;
    pub const QPN: Range<usize> = 8..12;
    pub const PSN: Range<usize> = 12..16;
    pub const RKEY: Range<usize> = 16..20;
    // 20..24: the C struct's padding before the 8-byte vaddr (perftest sends stack garbage).
    pub const VADDR: Range<usize> = 24..32;
    pub const GID: Range<usize> = 32..48;
    pub const SRQN: Range<usize> = 48..52;
    pub const GID_INDEX: Range<usize> = 52..56;
}

impl Dest {
    /// The 56 bytes (padding zeroed).
    pub fn encode(&self) -> [u8; DEST_LEN] {
        let mut b = [0u8; DEST_LEN];
        b[field::LID].copy_from_slice(&self.lid.to_be_bytes());
        b[field::OUT_READS].copy_from_slice(&self.out_reads.to_be_bytes());
        b[field::QPN].copy_from_slice(&self.qpn.to_be_bytes());
        b[field::PSN].copy_from_slice(&self.psn.to_be_bytes());
        b[field::RKEY].copy_from_slice(&self.rkey.to_be_bytes());
        b[field::VADDR].copy_from_slice(&self.vaddr.to_be_bytes());
        b[field::GID].copy_from_slice(&self.gid);
        b[field::SRQN].copy_from_slice(&self.srqn.to_be_bytes());
        b[field::GID_INDEX].copy_from_slice(&self.gid_index.to_be_bytes());
        b
    }

    /// Parses the 56 bytes (the padding is ignored).
    pub fn decode(b: &[u8]) -> Result<Self, ExchangeError> {
        let b = exact::<DEST_LEN>("destination", b)?;
        let u32_at = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[r]);
            u32::from_be_bytes(w)
        };
        let mut vaddr = [0u8; 8];
        vaddr.copy_from_slice(&b[field::VADDR]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[field::GID]);
        Ok(Self {
            lid: u32_at(field::LID),
            out_reads: u32_at(field::OUT_READS),
            qpn: u32_at(field::QPN),
            psn: u32_at(field::PSN),
            rkey: u32_at(field::RKEY),
            vaddr: u64::from_be_bytes(vaddr),
            gid,
            srqn: u32_at(field::SRQN),
            gid_index: u32_at(field::GID_INDEX),
        })
    }
}

/// One 8-byte report field: a big-endian u64.
pub fn encode_u64(v: u64) -> [u8; 8] {
    v.to_be_bytes()
}

/// Parses an 8-byte big-endian u64 report field.
pub fn decode_u64(what: &'static str, b: &[u8]) -> Result<u64, ExchangeError> {
    Ok(u64::from_be_bytes(*exact::<8>(what, b)?))
}

/// One 8-byte report field: a double, sent as its big-endian bit pattern (`hton_double`).
pub fn encode_f64(v: f64) -> [u8; 8] {
    v.to_bits().to_be_bytes()
}

/// Parses a double report field.
pub fn decode_f64(what: &'static str, b: &[u8]) -> Result<f64, ExchangeError> {
    Ok(f64::from_bits(decode_u64(what, b)?))
}

/// What `xchg_bw_reports` carries: the client's figures (perftest's server prints them).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BwReport {
    /// Message size in bytes.
    pub size: u64,
    /// Iterations.
    pub iters: u64,
    /// Peak bandwidth, MB/s (2^20 bytes).
    pub bw_peak: f64,
    /// Average bandwidth, MB/s.
    pub bw_avg: f64,
    /// Average message rate, millions per second.
    pub msg_rate: f64,
}

impl BwReport {
    /// The five messages, in exchange order.
    pub fn encode(&self) -> [[u8; 8]; 5] {
        [
            encode_u64(self.size),
            encode_u64(self.iters),
            encode_f64(self.bw_peak),
            encode_f64(self.bw_avg),
            encode_f64(self.msg_rate),
        ]
    }

    /// Parses the five messages.
    pub fn decode(m: &[Vec<u8>; 5]) -> Result<Self, ExchangeError> {
        Ok(Self {
            size: decode_u64("report size", &m[0])?,
            iters: decode_u64("report iterations", &m[1])?,
            bw_peak: decode_f64("report peak bandwidth", &m[2])?,
            bw_avg: decode_f64("report average bandwidth", &m[3])?,
            msg_rate: decode_f64("report message rate", &m[4])?,
        })
    }
}

/// Parses the credit word `ib_send_bw`'s receiver writes (little-endian u32).
pub fn decode_credit(b: &[u8]) -> Result<u32, ExchangeError> {
    Ok(u32::from_le_bytes(*exact::<4>("credit", b)?))
}

/// The credit word for `received` messages.
pub fn encode_credit(received: u32) -> [u8; 4] {
    received.to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // Payloads of the Sends in testdata/captures/siw-ib_write_bw.pcap (siw <-> siw,
    // perftest 4.5 `-R -s 4096 -n 5`), frames 8, 11, 13, 15, 28, 29, 79, 81, 83 and 87, and
    // of the credit Writes of siw-ib_send_bw.pcap, frames 75 and 77.
    const VERSION: &str = "362e3036000000000000000000000000";
    const CYCLE: &str = "00001000";
    const CACHE_LINE: &str = "00000040";
    const MTU: &str = "3300";
    const CLIENT_DEST: &str = "0000000000000001000000030009cf1febc5670000000000000055d7250f7000525400770002000000000000000000000000000000000000";
    const SERVER_DEST: &str = "00000000000000010000000400d48691a305c40000000000000056383ce3f000525400770002000000000000000000000000000000000000";
    const REPORT: [&str; 5] = [
        "0000000000001000",
        "0000000000000005",
        "400bbf33a800fe52",
        "4002c7602ed4dab2",
        "3f43b0e617947fce",
    ];

    #[test]
    fn the_captured_version_is_6_06_and_ours_encodes_to_the_same_bytes() {
        let v = decode_version(&hex(VERSION)).unwrap();
        assert_eq!(v.text, "6.06");
        assert!((v.number - 6.06).abs() < 1e-9);
        assert_eq!(encode_version(OUR_VERSION).to_vec(), hex(VERSION));
    }

    #[test]
    fn the_captured_sizes_are_4096_and_64_big_endian() {
        assert_eq!(decode_size("cycle", &hex(CYCLE), 1 << 30).unwrap(), 4096);
        assert_eq!(decode_size("cache", &hex(CACHE_LINE), 4096).unwrap(), 64);
        assert_eq!(encode_size(4096).to_vec(), hex(CYCLE));
    }

    #[test]
    fn the_captured_mtu_is_the_digit_3_and_a_nul() {
        assert_eq!(decode_mtu(&hex(MTU)).unwrap(), 3);
        assert_eq!(encode_mtu(3).to_vec(), hex(MTU));
    }

    #[test]
    fn the_captured_destinations_decode_field_by_field_and_reencode() {
        let c = Dest::decode(&hex(CLIENT_DEST)).unwrap();
        assert_eq!((c.lid, c.out_reads, c.qpn, c.psn), (0, 1, 3, 0x0009_cf1f));
        assert_eq!((c.rkey, c.vaddr), (0xebc5_6700, 0x0000_55d7_250f_7000));
        assert_eq!(&c.gid[..6], &[0x52, 0x54, 0x00, 0x77, 0x00, 0x02]);
        assert_eq!((c.srqn, c.gid_index), (0, 0));
        assert_eq!(c.encode().to_vec(), hex(CLIENT_DEST));
        let s = Dest::decode(&hex(SERVER_DEST)).unwrap();
        // The writes of that capture go to STag 0xa305c400 at 0x56383ce3f000.
        assert_eq!(
            (s.qpn, s.rkey, s.vaddr),
            (4, 0xa305_c400, 0x0000_5638_3ce3_f000)
        );
    }

    #[test]
    fn the_padding_of_a_destination_is_ignored() {
        // Frame 89 of the same capture: perftest sends stack garbage in the padding.
        let clean = hex(CLIENT_DEST);
        let mut b = clean.clone();
        b[20..24].copy_from_slice(&[0x00, 0xd7, 0x55, 0x00]);
        assert_eq!(Dest::decode(&b).unwrap(), Dest::decode(&clean).unwrap());
    }

    #[test]
    fn the_captured_report_is_4096_bytes_5_iterations_and_plausible_rates() {
        let m: [Vec<u8>; 5] = REPORT.map(hex);
        let r = BwReport::decode(&m).unwrap();
        assert_eq!((r.size, r.iters), (4096, 5));
        assert!(r.bw_peak > 3.0 && r.bw_peak < 4.0, "{}", r.bw_peak);
        assert!(r.bw_avg > 2.0 && r.bw_avg < 3.0, "{}", r.bw_avg);
        assert!(r.msg_rate > 0.0 && r.msg_rate < 0.01, "{}", r.msg_rate);
        let again = r.encode();
        for (a, b) in again.iter().zip(m.iter()) {
            assert_eq!(a.to_vec(), *b);
        }
    }

    #[test]
    fn the_captured_credits_are_little_endian_counts() {
        assert_eq!(decode_credit(&hex("02000000")).unwrap(), 2);
        assert_eq!(decode_credit(&hex("04000000")).unwrap(), 4);
        assert_eq!(encode_credit(4).to_vec(), hex("04000000"));
    }

    #[test]
    fn malformed_messages_give_typed_errors() {
        assert!(matches!(
            decode_version(&hex(CYCLE)),
            Err(ExchangeError::Length {
                got: 4,
                want: 16,
                ..
            })
        ));
        let mut v = encode_version("6.x6");
        assert!(matches!(
            decode_version(&v),
            Err(ExchangeError::BadVersion(_))
        ));
        v = encode_version("");
        assert!(matches!(
            decode_version(&v),
            Err(ExchangeError::BadVersion(_))
        ));
        v = encode_version("6.06");
        v[10] = b'1'; // text after the NUL
        assert!(matches!(
            decode_version(&v),
            Err(ExchangeError::BadVersion(_))
        ));
        assert!(matches!(
            decode_version(&encode_version("5.20")),
            Err(ExchangeError::OldVersion(_))
        ));
        assert!(matches!(
            decode_version(&encode_version("1..2")),
            Err(ExchangeError::BadVersion(_))
        ));
        assert!(matches!(
            decode_size("cycle", &hex("ffffffff"), 1 << 30),
            Err(ExchangeError::BadSize { value: -1, .. })
        ));
        assert!(matches!(
            decode_size("cycle", &hex("00000000"), 1 << 30),
            Err(ExchangeError::BadSize { value: 0, .. })
        ));
        assert!(matches!(
            decode_size("cache", &hex("0000100000"), 4096),
            Err(ExchangeError::Length { got: 5, .. })
        ));
        for bad in [&b"0\0"[..], b"3", b"6\0", b"\0\0", b"31", b"3\0\0"] {
            assert!(decode_mtu(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            Dest::decode(&[0u8; 55]),
            Err(ExchangeError::Length {
                got: 55,
                want: 56,
                ..
            })
        ));
        assert!(decode_u64("x", &[0u8; 4]).is_err());
        assert!(decode_credit(&[0u8; 8]).is_err());
    }

    #[test]
    fn any_56_bytes_are_a_destination_and_reencode_to_themselves_but_the_padding() {
        for seed in 0u8..=255 {
            let b: Vec<u8> = (0..DEST_LEN as u8)
                .map(|i| i.wrapping_mul(31) ^ seed)
                .collect();
            let d = Dest::decode(&b).unwrap();
            let mut again = d.encode().to_vec();
            again[20..24].copy_from_slice(&b[20..24]);
            assert_eq!(again, b);
        }
    }

    proptest::proptest! {
        /// Whatever a peer sends, every decoder answers a value or a typed error (no panic),
        /// and a decoded destination re-encodes to the bytes it came from, padding aside.
        #[test]
        fn no_decoder_panics_on_arbitrary_bytes(
            b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
            parts in proptest::collection::vec(
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..12), 5),
        ) {
            let _ = decode_version(&b);
            let _ = decode_size("cycle buffer", &b, u32::MAX);
            let _ = decode_mtu(&b);
            let _ = decode_u64("size", &b);
            let _ = decode_f64("peak", &b);
            let _ = decode_credit(&b);
            if let Ok(d) = Dest::decode(&b) {
                let again = d.encode();
                proptest::prop_assert_eq!(&again[..20], &b[..20]);
                proptest::prop_assert_eq!(&again[24..], &b[24..DEST_LEN]);
            }
            let report: [Vec<u8>; 5] = [
                parts[0].clone(), parts[1].clone(), parts[2].clone(), parts[3].clone(), parts[4].clone(),
            ];
            let _ = BwReport::decode(&report);
        }
    }
}
