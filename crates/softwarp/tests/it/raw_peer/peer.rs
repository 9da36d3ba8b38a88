//! A raw iWARP peer for tests: a plain `std::net::TcpStream` that performs the MPA
//! Request/Reply exchange itself (as initiator against a [`Listener`], or as responder to
//! [`QueuePair::connect`]) and then sends whatever FPDUs a test crafts, built only with the
//! wire crate's emitters. What the stack sends back is read as FPDUs (CRC checked when in
//! use) and handed to the test as ULPDUs. Every read has a timeout and every loop a bound.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softwarp::{ConnectOptions, ConnectionInfo, Listener, QueuePair};
use softwarp_wire::mpa::fpdu::{self, Fpdu};
use softwarp_wire::mpa::frame::{
    EnhancedParams, MpaFrame, MpaFrameKind, MpaRevision, RtrFlags, HEADER_LEN, MAX_PRIVATE_DATA_LEN,
};
use softwarp_wire::rdmap::{Message, Placement, Segment};

use crate::util::WAIT;

/// Most FPDUs any test reads from one connection (a bound for every read loop).
const MAX_FPDUS: usize = 10_000;

/// Which side opens the TCP connection and sends the MPA Request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The raw peer connects to a [`Listener`] and sends the MPA Request.
    Initiator,
    /// The raw peer listens; the stack's [`QueuePair::connect`] sends the Request.
    Responder,
}

/// What the raw peer asks for in its MPA frame (always revision 2 with the RFC 6581 prefix).
#[derive(Debug, Clone, Copy)]
pub struct Offer {
    /// The C bit.
    pub crc: bool,
    /// The IRD the raw peer advertises.
    pub ird: u16,
    /// The ORD the raw peer advertises.
    pub ord: u16,
}

impl Default for Offer {
    fn default() -> Self {
        Self {
            crc: true,
            ird: 8,
            ord: 8,
        }
    }
}

/// One FPDU the stack sent: the bytes on the wire and the ULPDU inside.
#[derive(Debug, Clone)]
pub struct Received {
    /// The whole FPDU (ULPDU_Length, ULPDU, pad, CRC).
    pub fpdu: Vec<u8>,
    /// The ULPDU (one DDP segment).
    pub ulpdu: Vec<u8>,
}

/// The raw end of an established iWARP connection.
#[derive(Debug)]
pub struct RawPeer {
    stream: TcpStream,
    /// CRC32c is in use on this connection (either side asked for it).
    pub crc: bool,
    /// The RFC 6581 parameters the stack sent in its MPA Request or Reply.
    pub stack_params: Option<EnhancedParams>,
    /// Bytes read from the stack that do not yet form a whole FPDU.
    rx: Vec<u8>,
}

/// The ULPDU of `seg`, emitted by the wire crate.
pub fn ulpdu(seg: &Segment<'_>) -> Vec<u8> {
    let mut out = vec![0u8; seg.buffer_len()];
    let n = seg.emit(&mut out).unwrap();
    out.truncate(n);
    out
}

impl RawPeer {
    /// Connects `qp` and a raw peer over loopback; `opts` are the stack's options.
    pub fn connect(
        role: Role,
        qp: &QueuePair,
        opts: &ConnectOptions,
        offer: Offer,
    ) -> (Self, ConnectionInfo) {
        match role {
            Role::Initiator => Self::initiate(qp, opts, offer),
            Role::Responder => Self::respond(qp, opts, offer),
        }
    }

    /// The raw peer connects to a [`Listener`] that accepts into `qp`.
    pub fn initiate(qp: &QueuePair, opts: &ConnectOptions, offer: Offer) -> (Self, ConnectionInfo) {
        let listener = Listener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::scope(|s| {
            let stack = s.spawn(|| listener.accept_timeout(qp, opts, WAIT));
            let mut stream = TcpStream::connect_timeout(&addr, WAIT).unwrap();
            prepare(&stream);
            write_frame(&mut stream, MpaFrameKind::Request, offer.crc, offer);
            let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
            let len = read_frame(&mut stream, &mut buf);
            let (reply, n) = MpaFrame::parse(&buf[..len]).unwrap();
            assert_eq!(n, len);
            assert_eq!(reply.kind, MpaFrameKind::Reply);
            assert!(!reply.reject, "the stack rejected the connection");
            assert!(!reply.marker, "the stack never asks for markers");
            assert_eq!(reply.revision, MpaRevision::Rev2);
            let info = stack.join().unwrap().unwrap();
            let peer = Self::new(stream, offer.crc || reply.crc, reply.enhanced);
            assert_eq!(info.crc, peer.crc, "both ends agree on CRC");
            (peer, info)
        })
    }

    /// The raw side alone of [`RawPeer::initiate`]: connects to a listener at `addr` (in
    /// another process, say) and performs the MPA exchange as initiator.
    pub fn initiate_to(addr: std::net::SocketAddr, offer: Offer) -> Self {
        let mut stream = TcpStream::connect_timeout(&addr, WAIT).unwrap();
        prepare(&stream);
        write_frame(&mut stream, MpaFrameKind::Request, offer.crc, offer);
        let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
        let len = read_frame(&mut stream, &mut buf);
        let (reply, n) = MpaFrame::parse(&buf[..len]).unwrap();
        assert_eq!(n, len);
        assert_eq!(reply.kind, MpaFrameKind::Reply);
        assert!(!reply.reject, "the stack rejected the connection");
        Self::new(stream, offer.crc || reply.crc, reply.enhanced)
    }

    /// Stops the TCP connection in an orderly way (FIN), without waiting for anything.
    pub fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// The raw peer listens; `qp` connects to it.
    pub fn respond(qp: &QueuePair, opts: &ConnectOptions, offer: Offer) -> (Self, ConnectionInfo) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        std::thread::scope(|s| {
            let stack = s.spawn(|| qp.connect(addr, opts));
            let mut stream = accept_within(&listener, WAIT);
            prepare(&stream);
            let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
            let len = read_frame(&mut stream, &mut buf);
            let (request, n) = MpaFrame::parse(&buf[..len]).unwrap();
            assert_eq!(n, len);
            assert_eq!(request.kind, MpaFrameKind::Request);
            assert!(!request.marker, "the stack never asks for markers");
            assert_eq!(request.revision, MpaRevision::Rev2);
            let stack_params = request.enhanced;
            //= https://www.rfc-editor.org/rfc/rfc5044#section-7.1
            // (paraphrase) CRC is used when either side sets C; a responder echoes the
            // initiator's C = 1 (as siw does).
            let crc = offer.crc || request.crc;
            write_frame(&mut stream, MpaFrameKind::Reply, crc, offer);
            let info = stack.join().unwrap().unwrap();
            let peer = Self::new(stream, crc, stack_params);
            assert_eq!(info.crc, peer.crc, "both ends agree on CRC");
            (peer, info)
        })
    }

    fn new(stream: TcpStream, crc: bool, stack_params: Option<EnhancedParams>) -> Self {
        Self {
            stream,
            crc,
            stack_params,
            rx: Vec::new(),
        }
    }

    /// Frames `ulpdu` as an FPDU (zero pad, CRC when in use) with the wire crate.
    pub fn frame(&self, ulpdu: &[u8]) -> Vec<u8> {
        let f = Fpdu { ulpdu };
        let mut out = vec![0u8; f.buffer_len()];
        let n = f.emit(&mut out, self.crc).unwrap();
        out.truncate(n);
        out
    }

    /// Sends `seg` as one FPDU; returns its ULPDU (what a Terminate copies back).
    pub fn send(&mut self, seg: &Segment<'_>) -> Vec<u8> {
        let u = ulpdu(seg);
        self.send_ulpdu(&u);
        u
    }

    /// Sends the initiator's first FPDU when the test wants the stack, as MPA responder, to
    /// send first: RFC 5044 holds a responder's FPDUs until the initiator's first one
    /// arrived. A zero-length RDMA Write to STag 1 (the form of Linux siw's RTR): it places
    /// nothing and completes nothing at the stack.
    pub fn speak_first(&mut self) {
        self.send(&Segment {
            last: true,
            placement: Placement::Tagged {
                stag: 1,
                tagged_offset: 0,
            },
            message: Message::RdmaWrite,
            payload: &[],
        });
    }

    /// Frames and sends a ULPDU (possibly corrupted by the test before framing).
    pub fn send_ulpdu(&mut self, ulpdu: &[u8]) {
        let f = self.frame(ulpdu);
        self.send_bytes(&f);
    }

    /// Sends bytes as they are (whole FPDUs, or deliberately corrupted ones).
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// The next FPDU from the stack (its CRC checked when CRC is in use); `None` once the
    /// stack closed the connection. Panics after [`WAIT`] without either.
    pub fn next_fpdu(&mut self) -> Option<Received> {
        let deadline = Instant::now() + WAIT;
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            if self.rx.len() >= fpdu::HEADER_LEN {
                let len = fpdu::peek(&self.rx).unwrap();
                if self.rx.len() >= len {
                    let bytes: Vec<u8> = self.rx.drain(..len).collect();
                    let (f, n) = Fpdu::parse(&bytes, self.crc).unwrap_or_else(|e| {
                        panic!("the stack sent a bad FPDU ({e}): {bytes:02x?}")
                    });
                    assert_eq!(n, len);
                    let ulpdu = f.ulpdu.to_vec();
                    return Some(Received { fpdu: bytes, ulpdu });
                }
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for an FPDU from the stack ({} bytes pending)",
                self.rx.len()
            );
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    assert!(
                        self.rx.is_empty(),
                        "the stack closed the stream inside an FPDU: {:02x?}",
                        self.rx
                    );
                    return None;
                }
                Ok(n) => self.rx.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => panic!("reading from the stack failed: {e}"),
            }
        }
    }

    /// Reads FPDUs until the stack's Terminate. Returns the FPDUs before it (at most
    /// `max_before`, e.g. Read Responses the stack still owed) and the Terminate.
    pub fn read_until_terminate(&mut self, max_before: usize) -> (Vec<Received>, Received) {
        let mut before = Vec::new();
        for _ in 0..MAX_FPDUS {
            let Some(r) = self.next_fpdu() else {
                panic!(
                    "the stack closed the connection without a Terminate (after {} FPDUs)",
                    before.len()
                );
            };
            let seg = Segment::parse(&r.ulpdu)
                .unwrap_or_else(|e| panic!("the stack sent a bad ULPDU ({e}): {:02x?}", r.ulpdu));
            if matches!(seg.message, Message::Terminate(_)) {
                return (before, r);
            }
            assert!(
                before.len() < max_before,
                "expected a Terminate, got {seg:?} (FPDU {} from the stack)",
                before.len() + 1
            );
            before.push(r);
        }
        panic!("no Terminate within {MAX_FPDUS} FPDUs");
    }

    /// The stack's next FPDU, which must be its Terminate.
    pub fn expect_terminate(&mut self) -> Received {
        self.read_until_terminate(0).1
    }

    /// Sends a burst that may outlast the connection (the stack terminates and closes in
    /// the middle of it): stops at the first failed write. Returns the bytes the kernel took.
    pub fn send_burst(&mut self, bytes: &[u8]) -> usize {
        let mut sent = 0;
        for chunk in bytes.chunks(64 * 1024) {
            match self.stream.write_all(chunk) {
                Ok(()) => sent += chunk.len(),
                Err(_) => break,
            }
        }
        sent
    }

    /// After the Terminate: the stack sends nothing more and closes the connection, with a
    /// FIN, or with a reset when it closed with bytes of a burst still unread.
    pub fn expect_close_or_reset(&mut self) {
        assert!(
            self.rx.is_empty(),
            "more after the Terminate: {:02x?}",
            self.rx
        );
        let mut chunk = [0u8; 4096];
        for _ in 0..MAX_FPDUS {
            match self.stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => panic!(
                    "the stack sent more after its Terminate: {:02x?}",
                    &chunk[..n]
                ),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
                Err(e) => panic!("reading from the stack failed: {e}"),
            }
        }
    }

    /// The stack sends nothing more and closes the TCP connection (FIN).
    pub fn expect_close(&mut self) {
        if let Some(r) = self.next_fpdu() {
            panic!("the stack sent more after its Terminate: {:02x?}", r.ulpdu);
        }
    }
}

fn prepare(stream: &TcpStream) {
    stream.set_nonblocking(false).unwrap();
    stream.set_nodelay(true).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.set_write_timeout(Some(WAIT)).unwrap();
}

fn accept_within(listener: &TcpListener, limit: Duration) -> TcpStream {
    let deadline = Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((s, _)) => return s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < deadline,
                    "the stack did not connect in time"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("accept failed: {e}"),
        }
    }
}

/// Emits and sends an MPA frame of `kind` (revision 2, RFC 6581 prefix, no markers).
fn write_frame(stream: &mut TcpStream, kind: MpaFrameKind, crc: bool, offer: Offer) {
    let frame = MpaFrame {
        kind,
        marker: false,
        crc,
        reject: false,
        revision: MpaRevision::Rev2,
        enhanced: Some(EnhancedParams {
            ird: offer.ird,
            ord: offer.ord,
            peer_to_peer: false,
            rtr: RtrFlags::NONE,
        }),
        private_data: &[],
    };
    let mut buf = [0u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN];
    let n = frame.emit(&mut buf).unwrap();
    stream.write_all(&buf[..n]).unwrap();
}

/// Reads exactly one MPA frame (nothing after it); returns its length.
fn read_frame(stream: &mut TcpStream, buf: &mut [u8; HEADER_LEN + MAX_PRIVATE_DATA_LEN]) -> usize {
    let mut have = 0;
    // A frame is at most 532 bytes and each pass normally reads at least one.
    for _ in 0..=buf.len() {
        let need = MpaFrame::needed(&buf[..have]).unwrap();
        if need == 0 {
            return have;
        }
        match stream.read(&mut buf[have..have + need]) {
            Ok(0) => panic!("the stack closed the connection during the MPA exchange"),
            Ok(n) => have += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("reading the stack's MPA frame failed: {e}"),
        }
    }
    panic!("no whole MPA frame after {have} bytes");
}
