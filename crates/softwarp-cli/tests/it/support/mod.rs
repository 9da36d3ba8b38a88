//! Builds small synthetic captures for the decoder tests: TCP connections over Ethernet/IPv4
//! in a classic pcap file, with MPA frames and FPDUs made by `softwarp-wire`.
#![allow(dead_code)] // each test file uses a different part
#![allow(clippy::unwrap_used)] // test support: a panic is a test failure

use etherparse::PacketBuilder;
use softwarp_wire::mpa::{
    marker, EnhancedParams, Fpdu, MpaFrame, MpaFrameKind, MpaRevision, RtrFlags,
};
use softwarp_wire::rdmap::{Message, Placement, Segment};

/// Frames of a capture being built.
#[derive(Default)]
pub struct Capture {
    frames: Vec<Vec<u8>>,
}

impl Capture {
    /// Adds one Ethernet/IPv4/TCP frame; returns its frame number.
    #[allow(clippy::too_many_arguments)]
    pub fn tcp(
        &mut self,
        src: Endpoint,
        dst: Endpoint,
        seq: u32,
        syn: bool,
        ack: bool,
        payload: &[u8],
    ) -> u64 {
        let mut b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4(src.0, dst.0, 64)
            .tcp(src.1, dst.1, seq, 65535);
        if syn {
            b = b.syn();
        }
        if ack {
            b = b.ack(1);
        }
        let mut frame = Vec::new();
        b.write(&mut frame, payload).unwrap();
        self.frames.push(frame);
        self.frames.len() as u64
    }

    /// Adds an arbitrary frame (e.g. an ARP); returns its number.
    pub fn raw(&mut self, frame: Vec<u8>) -> u64 {
        self.frames.push(frame);
        self.frames.len() as u64
    }

    /// The capture as a little-endian microsecond pcap with Ethernet frames.
    pub fn pcap(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
        v.extend_from_slice(&2u16.to_le_bytes());
        v.extend_from_slice(&4u16.to_le_bytes());
        v.extend_from_slice(&[0; 8]);
        v.extend_from_slice(&262_144u32.to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes());
        for (i, f) in self.frames.iter().enumerate() {
            v.extend_from_slice(&(i as u32).to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
            v.extend_from_slice(&(f.len() as u32).to_le_bytes());
            v.extend_from_slice(&(f.len() as u32).to_le_bytes());
            v.extend_from_slice(f);
        }
        v
    }
}

/// An IPv4 address and a port.
pub type Endpoint = ([u8; 4], u16);

/// One TCP connection in a [`Capture`], keeping each side's next sequence number.
pub struct Conn {
    pub client: Endpoint,
    pub server: Endpoint,
    /// Next sequence number of each side (client, server).
    pub next: [u32; 2],
}

/// Which side sends.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    Client,
    Server,
}

impl Conn {
    /// A handshake between `client_port` and port 7174; returns the connection.
    pub fn open(cap: &mut Capture, client_port: u16, isn: [u32; 2]) -> Self {
        let client = ([10, 0, 0, 1], client_port);
        let server = ([10, 0, 0, 2], 7174);
        cap.tcp(client, server, isn[0], true, false, &[]);
        cap.tcp(server, client, isn[1], true, true, &[]);
        Conn {
            client,
            server,
            next: [isn[0].wrapping_add(1), isn[1].wrapping_add(1)],
        }
    }

    fn ends(&self, side: Side) -> (Endpoint, Endpoint, usize) {
        match side {
            Side::Client => (self.client, self.server, 0),
            Side::Server => (self.server, self.client, 1),
        }
    }

    /// Sends `bytes` from `side` in one segment; returns the frame number.
    pub fn send(&mut self, cap: &mut Capture, side: Side, bytes: &[u8]) -> u64 {
        let (src, dst, i) = self.ends(side);
        let frame = cap.tcp(src, dst, self.next[i], false, true, bytes);
        self.next[i] = self.next[i].wrapping_add(bytes.len() as u32);
        frame
    }

    /// Sends `bytes` from `side` at an explicit sequence offset from the side's current next
    /// sequence number, without advancing it (for reordering and retransmissions).
    pub fn send_at(&self, cap: &mut Capture, side: Side, rel: u32, bytes: &[u8]) -> u64 {
        let (src, dst, i) = self.ends(side);
        cap.tcp(src, dst, self.next[i].wrapping_add(rel), false, true, bytes)
    }

    /// Advances `side`'s sequence number by `n` (after `send_at` segments).
    pub fn advance(&mut self, side: Side, n: usize) {
        let i = self.ends(side).2;
        self.next[i] = self.next[i].wrapping_add(n as u32);
    }
}

/// An MPA frame's bytes.
pub fn mpa_frame(
    kind: MpaFrameKind,
    markers: bool,
    crc: bool,
    reject: bool,
    rev2: bool,
    private_data: &[u8],
) -> Vec<u8> {
    let frame = MpaFrame {
        kind,
        marker: markers,
        crc,
        reject,
        revision: if rev2 {
            MpaRevision::Rev2
        } else {
            MpaRevision::Rev1
        },
        enhanced: rev2.then_some(EnhancedParams {
            ird: 4,
            ord: 4,
            peer_to_peer: false,
            rtr: RtrFlags::NONE,
        }),
        private_data,
    };
    let mut out = vec![0u8; frame.buffer_len()];
    frame.emit(&mut out).unwrap();
    out
}

/// A Send ULPDU (untagged, queue 0) carrying `payload`.
pub fn send_ulpdu(msn: u32, payload: &[u8]) -> Vec<u8> {
    let seg = Segment {
        last: true,
        placement: Placement::Untagged { msn, mo: 0 },
        message: Message::Send,
        payload,
    };
    let mut out = vec![0u8; seg.buffer_len()];
    seg.emit(&mut out).unwrap();
    out
}

/// An RDMA Write ULPDU (tagged) carrying `payload`.
pub fn write_ulpdu(stag: u32, to: u64, payload: &[u8]) -> Vec<u8> {
    let seg = Segment {
        last: true,
        placement: Placement::Tagged {
            stag,
            tagged_offset: to,
        },
        message: Message::RdmaWrite,
        payload,
    };
    let mut out = vec![0u8; seg.buffer_len()];
    seg.emit(&mut out).unwrap();
    out
}

/// A marker-free FPDU around `ulpdu`.
pub fn fpdu(ulpdu: &[u8], crc: bool) -> Vec<u8> {
    let f = Fpdu { ulpdu };
    let mut out = vec![0u8; f.buffer_len()];
    f.emit(&mut out, crc).unwrap();
    out
}

/// The FPDU around `ulpdu` with markers inserted for FPDU stream offset `stream_offset`.
pub fn marked_fpdu(ulpdu: &[u8], stream_offset: u64, crc: bool) -> Vec<u8> {
    let plain = fpdu(ulpdu, false);
    let mut out = vec![0u8; plain.len() + 4 * (plain.len() / 512 + 2)];
    let n = marker::insert(&plain, stream_offset, crc, &mut out).unwrap();
    out.truncate(n);
    out
}
