//! Link, IP and TCP headers of one frame, peeled off with `etherparse`.
//!
//! Only what stream reassembly needs is kept: the two endpoints, the sequence number, the
//! SYN/FIN/RST flags and the TCP payload. Frames that are not TCP (ARP, UDP, IP fragments) are
//! not errors; they are simply not segments. No I/O here.

use std::net::{IpAddr, SocketAddr};

use etherparse::{EtherType, NetSlice, SlicedPacket, TransportSlice};

use super::error::CaptureError;
use super::file::LinkType;

/// Length of a Linux cooked capture v2 header; its first two bytes are the EtherType.
const SLL2_HEADER_LEN: usize = 20;
/// Length of the BSD/OpenBSD loopback header (an address family).
const LOOPBACK_HEADER_LEN: usize = 4;
/// Address family values that mean IPv4 and IPv6 in a loopback header, across the BSDs,
/// Linux and macOS (IPv6 is 10, 24, 28 or 30 depending on the OS).
const AF_INET: u32 = 2;
const AF_INET6: [u32; 4] = [10, 24, 28, 30];

/// The TCP part of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSegment<'a> {
    /// Sender's address and port.
    pub src: SocketAddr,
    /// Receiver's address and port.
    pub dst: SocketAddr,
    /// Sequence number of the first payload byte (or of the SYN).
    pub seq: u32,
    /// SYN flag.
    pub syn: bool,
    /// ACK flag.
    pub ack: bool,
    /// FIN flag.
    pub fin: bool,
    /// RST flag.
    pub rst: bool,
    /// The TCP payload as captured.
    pub payload: &'a [u8],
}

fn malformed(frame: u64, reason: impl std::fmt::Display) -> CaptureError {
    CaptureError::MalformedPacket {
        frame,
        reason: reason.to_string(),
    }
}

fn loopback_family(frame: u64, data: &[u8], big_endian: bool) -> Result<u32, CaptureError> {
    match data.get(..LOOPBACK_HEADER_LEN) {
        Some(&[a, b, c, d]) => Ok(if big_endian {
            u32::from_be_bytes([a, b, c, d])
        } else {
            // The family is in the capturing host's byte order; values are small, so
            // whichever order gives a small number is the right one.
            let le = u32::from_le_bytes([a, b, c, d]);
            if le <= 0xffff {
                le
            } else {
                u32::from_be_bytes([a, b, c, d])
            }
        }),
        _ => Err(malformed(frame, "loopback header truncated")),
    }
}

/// Peels the headers off frame `frame` (its number, for error messages) of link type `link`.
///
/// Returns `Ok(None)` for frames that carry no TCP segment, and an error for frames whose
/// headers are malformed or truncated (for example cut by the snap length).
pub fn tcp_segment(
    frame: u64,
    link: LinkType,
    data: &[u8],
) -> Result<Option<TcpSegment<'_>>, CaptureError> {
    let sliced = match link {
        LinkType::Ethernet => SlicedPacket::from_ethernet(data),
        LinkType::LinuxSll => SlicedPacket::from_linux_sll(data),
        LinkType::LinuxSll2 => {
            let (Some(&[hi, lo]), Some(rest)) = (data.get(..2), data.get(SLL2_HEADER_LEN..)) else {
                return Err(malformed(frame, "Linux cooked v2 header truncated"));
            };
            SlicedPacket::from_ether_type(EtherType(u16::from_be_bytes([hi, lo])), rest)
        }
        LinkType::RawIp | LinkType::Ipv4 | LinkType::Ipv6 => SlicedPacket::from_ip(data),
        LinkType::Null | LinkType::Loop => {
            let family = loopback_family(frame, data, link == LinkType::Loop)?;
            let rest = data.get(LOOPBACK_HEADER_LEN..).unwrap_or_default();
            if family == AF_INET || AF_INET6.contains(&family) {
                SlicedPacket::from_ip(rest)
            } else {
                return Ok(None);
            }
        }
        LinkType::Other(link) => return Err(CaptureError::UnsupportedLinkType { frame, link }),
    }
    .map_err(|e| malformed(frame, e))?;

    let (src_ip, dst_ip): (IpAddr, IpAddr) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
        ),
        Some(NetSlice::Ipv6(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
        ),
        None => return Ok(None),
    };
    let Some(TransportSlice::Tcp(tcp)) = &sliced.transport else {
        return Ok(None);
    };
    Ok(Some(TcpSegment {
        src: SocketAddr::new(src_ip, tcp.source_port()),
        dst: SocketAddr::new(dst_ip, tcp.destination_port()),
        seq: tcp.sequence_number(),
        syn: tcp.syn(),
        ack: tcp.ack(),
        fin: tcp.fin(),
        rst: tcp.rst(),
        payload: tcp.payload(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::PacketBuilder;

    fn ipv4_tcp(payload: &[u8]) -> Vec<u8> {
        let builder = PacketBuilder::ipv4([192, 168, 77, 1], [192, 168, 77, 2], 64)
            .tcp(50000, 7174, 1000, 512)
            .ack(1)
            .psh();
        let mut out = Vec::new();
        builder.write(&mut out, payload).unwrap();
        out
    }

    #[test]
    fn ethernet_ipv4_tcp_yields_ports_sequence_and_payload() {
        let builder = PacketBuilder::ethernet2([1; 6], [2; 6])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .tcp(1234, 7174, 0xffff_fff0, 512)
            .syn();
        let mut frame = Vec::new();
        builder.write(&mut frame, &[]).unwrap();
        let seg = tcp_segment(1, LinkType::Ethernet, &frame).unwrap().unwrap();
        assert_eq!(seg.src, "10.0.0.1:1234".parse().unwrap());
        assert_eq!(seg.dst, "10.0.0.2:7174".parse().unwrap());
        assert_eq!(seg.seq, 0xffff_fff0);
        assert!(seg.syn && !seg.ack && !seg.fin && !seg.rst);
        assert!(seg.payload.is_empty());
    }

    #[test]
    fn ethernet_minimum_frame_padding_is_not_tcp_payload() {
        let builder = PacketBuilder::ethernet2([1; 6], [2; 6])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .tcp(1234, 7174, 7, 512);
        let mut frame = Vec::new();
        builder.write(&mut frame, b"ab").unwrap();
        frame.resize(60, 0xee);
        let seg = tcp_segment(1, LinkType::Ethernet, &frame).unwrap().unwrap();
        assert_eq!(seg.payload, b"ab");
    }

    #[test]
    fn raw_ip_linux_cooked_and_loopback_links_are_understood() {
        let ip = ipv4_tcp(b"hello");
        let seg = tcp_segment(1, LinkType::RawIp, &ip).unwrap().unwrap();
        assert_eq!(seg.payload, b"hello");

        let mut sll2 = vec![0x08, 0x00];
        sll2.resize(SLL2_HEADER_LEN, 0);
        sll2.extend_from_slice(&ip);
        let seg = tcp_segment(2, LinkType::LinuxSll2, &sll2).unwrap().unwrap();
        assert_eq!(seg.payload, b"hello");

        let mut sll = vec![0, 0, 0, 1, 0, 6, 1, 2, 3, 4, 5, 6, 0, 0, 0x08, 0x00];
        sll.extend_from_slice(&ip);
        let seg = tcp_segment(3, LinkType::LinuxSll, &sll).unwrap().unwrap();
        assert_eq!(seg.dst.port(), 7174);

        let mut null = 2u32.to_le_bytes().to_vec();
        null.extend_from_slice(&ip);
        let seg = tcp_segment(4, LinkType::Null, &null).unwrap().unwrap();
        assert_eq!(seg.src.port(), 50000);

        let mut lo = 2u32.to_be_bytes().to_vec();
        lo.extend_from_slice(&ip);
        assert!(tcp_segment(5, LinkType::Loop, &lo).unwrap().is_some());
    }

    #[test]
    fn ipv6_tcp_is_understood() {
        let builder = PacketBuilder::ipv6([1; 16], [2; 16], 64).tcp(1, 2, 3, 4);
        let mut ip = Vec::new();
        builder.write(&mut ip, b"v6").unwrap();
        let seg = tcp_segment(1, LinkType::Ipv6, &ip).unwrap().unwrap();
        assert!(seg.src.is_ipv6());
        assert_eq!(seg.payload, b"v6");
    }

    #[test]
    fn udp_and_arp_are_not_segments() {
        let builder = PacketBuilder::ipv4([1, 1, 1, 1], [2, 2, 2, 2], 64).udp(1, 2);
        let mut udp = Vec::new();
        builder.write(&mut udp, b"x").unwrap();
        assert!(tcp_segment(1, LinkType::RawIp, &udp).unwrap().is_none());
        let mut arp = vec![0xff; 12];
        arp.extend_from_slice(&[0x08, 0x06]);
        arp.resize(42, 0);
        assert!(tcp_segment(2, LinkType::Ethernet, &arp).unwrap().is_none());
    }

    #[test]
    fn truncated_headers_are_malformed_at_every_length() {
        let ip = ipv4_tcp(b"payload");
        for len in 0..ip.len() {
            match tcp_segment(9, LinkType::RawIp, &ip[..len]) {
                Err(CaptureError::MalformedPacket { frame: 9, .. }) => {}
                other => panic!("length {len}: unexpected {other:?}"),
            }
        }
        assert!(matches!(
            tcp_segment(9, LinkType::LinuxSll2, &[0x08]),
            Err(CaptureError::MalformedPacket { .. })
        ));
        assert!(matches!(
            tcp_segment(9, LinkType::Null, &[2, 0]),
            Err(CaptureError::MalformedPacket { .. })
        ));
    }

    #[test]
    fn unknown_link_types_are_reported() {
        assert!(matches!(
            tcp_segment(3, LinkType::Other(147), &[0; 40]),
            Err(CaptureError::UnsupportedLinkType {
                frame: 3,
                link: 147
            })
        ));
    }
}
