//! Raw MPA peers over plain TCP, for tests that send what a stack never would or check
//! what a stack sends byte by byte.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softwarp_wire::mpa::frame::MpaFrame;

use crate::util::WAIT;

/// An MPA frame: `key`, the flags octet, the revision, PD_Length and the private data.
pub fn frame(key: &[u8; 16], flags: u8, rev: u8, pd: &[u8]) -> Vec<u8> {
    let mut v = key.to_vec();
    v.push(flags);
    v.push(rev);
    v.extend_from_slice(&(pd.len() as u16).to_be_bytes());
    v.extend_from_slice(pd);
    v
}

/// The key of an MPA Request.
pub const REQ: &[u8; 16] = b"MPA ID Req Frame";
/// The key of an MPA Reply.
pub const REP: &[u8; 16] = b"MPA ID Rep Frame";

/// Connects, writes `bytes`, and returns everything the listener sends until it closes.
pub fn raw_initiator(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(bytes).unwrap();
    let mut got = Vec::new();
    let t0 = Instant::now();
    let _ = s.read_to_end(&mut got);
    assert!(
        t0.elapsed() < WAIT,
        "the listener never closed the connection"
    );
    got
}

/// What a raw responder saw: the Request, and the bytes that followed it.
pub type Seen = (Vec<u8>, Vec<u8>);

/// Reads one whole MPA Request from `s` (bounded by [`WAIT`]), byte counts from the wire
/// crate's incremental `needed`.
pub fn read_request(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut req = Vec::new();
    loop {
        let need = MpaFrame::needed(&req).unwrap();
        if need == 0 {
            return req;
        }
        let mut b = vec![0u8; need];
        s.read_exact(&mut b).unwrap();
        req.extend_from_slice(&b);
    }
}

/// A raw responder: reads the MPA Request, answers `reply` (or nothing), then returns the
/// Request and everything the initiator sent after it until it closed.
pub fn raw_responder(reply: Option<Vec<u8>>) -> (SocketAddr, JoinHandle<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let req = read_request(&mut s);
        match reply {
            Some(r) => s.write_all(&r).unwrap(),
            None => std::thread::sleep(Duration::from_millis(800)),
        }
        let mut after = Vec::new();
        let _ = s.read_to_end(&mut after);
        (req, after)
    });
    (addr, h)
}
