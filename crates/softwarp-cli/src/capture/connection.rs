//! TCP connections in a capture, each with its two reassembled directions.
//!
//! Connections are numbered in order of first appearance. The client is the endpoint that
//! sent the first SYN (without ACK); when the capture starts after the handshake, it is the
//! sender of the first segment seen. A new SYN on a known address pair with a different
//! initial sequence number starts a new connection (port reuse). No I/O here.

use std::collections::HashMap;
use std::net::SocketAddr;

use super::packet::TcpSegment;
use super::reassembly::{StreamEvent, StreamReassembler};

/// Index of a connection in order of first appearance, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub usize);

/// One direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the endpoint that opened the connection.
    FromClient,
    /// From the endpoint that accepted it.
    FromServer,
}

impl Direction {
    /// The other direction.
    pub fn reverse(self) -> Self {
        match self {
            Self::FromClient => Self::FromServer,
            Self::FromServer => Self::FromClient,
        }
    }

    fn index(self) -> usize {
        match self {
            Self::FromClient => 0,
            Self::FromServer => 1,
        }
    }
}

/// A connection's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// Its number.
    pub id: ConnectionId,
    /// The endpoint that opened it.
    pub client: SocketAddr,
    /// The endpoint that accepted it.
    pub server: SocketAddr,
    /// The first frame of the connection in the capture.
    pub first_frame: u64,
}

impl Connection {
    /// Sender and receiver of `direction`.
    pub fn endpoints(&self, direction: Direction) -> (SocketAddr, SocketAddr) {
        match direction {
            Direction::FromClient => (self.client, self.server),
            Direction::FromServer => (self.server, self.client),
        }
    }
}

/// In-order stream data (or a hole) of one direction of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowEvent<'a> {
    /// The connection.
    pub connection: ConnectionId,
    /// Its endpoints.
    pub endpoints: Connection,
    /// Which way the bytes flow.
    pub direction: Direction,
    /// The bytes or the hole.
    pub kind: FlowEventKind<'a>,
}

/// The payload of a [`FlowEvent`]; the same as a reassembler's [`StreamEvent`].
pub type FlowEventKind<'a> = StreamEvent<'a>;

#[derive(Debug)]
struct State {
    info: Connection,
    streams: [StreamReassembler; 2],
}

/// Sorts segments into connections and reassembles both directions of each.
#[derive(Debug)]
pub struct ConnectionTracker {
    by_endpoints: HashMap<(SocketAddr, SocketAddr), usize>,
    connections: Vec<State>,
    pending_limit: usize,
    last_frame: u64,
}

impl Default for ConnectionTracker {
    fn default() -> Self {
        Self::new(super::reassembly::DEFAULT_PENDING_LIMIT)
    }
}

fn key(a: SocketAddr, b: SocketAddr) -> (SocketAddr, SocketAddr) {
    if a <= b {
        (a, b)
    } else {
        (b, a)
    }
}

impl ConnectionTracker {
    /// A tracker whose reassemblers each hold at most about `pending_limit` bytes behind a hole.
    pub fn new(pending_limit: usize) -> Self {
        Self {
            by_endpoints: HashMap::new(),
            connections: Vec::new(),
            pending_limit,
            last_frame: 0,
        }
    }

    /// The connection numbered `id`.
    pub fn connection(&self, id: ConnectionId) -> Option<&Connection> {
        self.connections.get(id.0).map(|s| &s.info)
    }

    /// Every connection seen so far, in order of first appearance.
    pub fn connections(&self) -> impl Iterator<Item = &Connection> {
        self.connections.iter().map(|s| &s.info)
    }

    fn new_connection(&mut self, frame: u64, segment: &TcpSegment<'_>) -> usize {
        let index = self.connections.len();
        let (client, server) = if segment.syn && segment.ack {
            (segment.dst, segment.src)
        } else {
            (segment.src, segment.dst)
        };
        self.connections.push(State {
            info: Connection {
                id: ConnectionId(index),
                client,
                server,
                first_frame: frame,
            },
            streams: [
                StreamReassembler::new(self.pending_limit),
                StreamReassembler::new(self.pending_limit),
            ],
        });
        self.by_endpoints
            .insert(key(segment.src, segment.dst), index);
        index
    }

    /// Feeds the TCP segment of frame `frame`; `sink` receives the in-order bytes it releases.
    pub fn segment(
        &mut self,
        frame: u64,
        segment: &TcpSegment<'_>,
        sink: &mut dyn FnMut(FlowEvent<'_>),
    ) {
        self.last_frame = self.last_frame.max(frame);
        let index = match self.by_endpoints.get(&key(segment.src, segment.dst)) {
            Some(&index) if !self.is_new_open(index, segment) => index,
            _ => self.new_connection(frame, segment),
        };
        let Some(state) = self.connections.get_mut(index) else {
            return;
        };
        let direction = if segment.src == state.info.client {
            Direction::FromClient
        } else {
            Direction::FromServer
        };
        let endpoints = state.info;
        if let Some(stream) = state.streams.get_mut(direction.index()) {
            stream.segment(
                frame,
                segment.seq,
                segment.syn,
                segment.payload,
                &mut |kind| {
                    sink(FlowEvent {
                        connection: endpoints.id,
                        endpoints,
                        direction,
                        kind,
                    })
                },
            );
        }
    }

    /// True when `segment` is a SYN that opens a new connection on the address pair of
    /// connection `index` (a different initial sequence number from the client).
    fn is_new_open(&self, index: usize, segment: &TcpSegment<'_>) -> bool {
        if !segment.syn || segment.ack {
            return false;
        }
        let Some(state) = self.connections.get(index) else {
            return true;
        };
        let from_client = segment.src == state.info.client;
        match state.streams.get(Direction::FromClient.index()) {
            Some(stream) => match stream.initial_sequence() {
                Some(isn) => !from_client || isn != segment.seq.wrapping_add(1),
                None => false,
            },
            None => true,
        }
    }

    /// End of capture: every direction reports its holes and delivers what waited behind them.
    pub fn finish(&mut self, sink: &mut dyn FnMut(FlowEvent<'_>)) {
        let frame = self.last_frame;
        for state in &mut self.connections {
            let endpoints = state.info;
            for direction in [Direction::FromClient, Direction::FromServer] {
                if let Some(stream) = state.streams.get_mut(direction.index()) {
                    stream.finish(frame, &mut |kind| {
                        sink(FlowEvent {
                            connection: endpoints.id,
                            endpoints,
                            direction,
                            kind,
                        })
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg<'a>(src: &str, dst: &str, seq: u32, flags: &str, payload: &'a [u8]) -> TcpSegment<'a> {
        TcpSegment {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            seq,
            syn: flags.contains('S'),
            ack: flags.contains('A'),
            fin: flags.contains('F'),
            rst: flags.contains('R'),
            payload,
        }
    }

    const C: &str = "10.0.0.1:40000";
    const S: &str = "10.0.0.2:7174";

    fn collect(
        tracker: &mut ConnectionTracker,
        segments: &[(u64, TcpSegment<'_>)],
    ) -> Vec<(usize, Direction, Vec<u8>)> {
        let mut out = Vec::new();
        for (frame, s) in segments {
            tracker.segment(*frame, s, &mut |ev| {
                if let StreamEvent::Data { bytes, .. } = ev.kind {
                    out.push((ev.connection.0, ev.direction, bytes.to_vec()));
                }
            });
        }
        out
    }

    #[test]
    fn handshake_assigns_client_and_server_and_both_directions_reassemble() {
        let mut t = ConnectionTracker::default();
        let out = collect(
            &mut t,
            &[
                (1, seg(C, S, 100, "S", b"")),
                (2, seg(S, C, 500, "SA", b"")),
                (3, seg(C, S, 101, "A", b"req")),
                (4, seg(S, C, 501, "A", b"rep")),
            ],
        );
        assert_eq!(
            out,
            [
                (0, Direction::FromClient, b"req".to_vec()),
                (0, Direction::FromServer, b"rep".to_vec())
            ]
        );
        let c = t.connection(ConnectionId(0)).unwrap();
        assert_eq!(c.client, C.parse().unwrap());
        assert_eq!(c.server, S.parse().unwrap());
        assert_eq!(c.first_frame, 1);
        assert_eq!(c.endpoints(Direction::FromServer).0, S.parse().unwrap());
    }

    #[test]
    fn capture_starting_at_syn_ack_still_knows_the_client() {
        let mut t = ConnectionTracker::default();
        collect(&mut t, &[(1, seg(S, C, 500, "SA", b""))]);
        assert_eq!(
            t.connection(ConnectionId(0)).unwrap().client,
            C.parse().unwrap()
        );
    }

    #[test]
    fn a_new_syn_on_the_same_ports_starts_a_new_connection() {
        let mut t = ConnectionTracker::default();
        let out = collect(
            &mut t,
            &[
                (1, seg(C, S, 100, "S", b"")),
                (2, seg(C, S, 101, "A", b"one")),
                (3, seg(C, S, 100, "S", b"")),
                (4, seg(C, S, 9000, "S", b"")),
                (5, seg(C, S, 9001, "A", b"two")),
            ],
        );
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].0, 0);
        assert_eq!(out[1], (1, Direction::FromClient, b"two".to_vec()));
        assert_eq!(t.connections().count(), 2);
    }

    #[test]
    fn separate_address_pairs_are_separate_connections() {
        let mut t = ConnectionTracker::default();
        let other = "10.0.0.3:40001";
        let out = collect(
            &mut t,
            &[
                (1, seg(C, S, 1, "S", b"")),
                (2, seg(other, S, 1, "S", b"")),
                (3, seg(other, S, 2, "A", b"b")),
                (4, seg(C, S, 2, "A", b"a")),
            ],
        );
        assert_eq!(out[0].0, 1);
        assert_eq!(out[1].0, 0);
    }

    #[test]
    fn finish_reports_holes_per_direction() {
        let mut t = ConnectionTracker::default();
        collect(
            &mut t,
            &[(1, seg(C, S, 1, "S", b"")), (2, seg(C, S, 5, "A", b"late"))],
        );
        let mut gaps = Vec::new();
        t.finish(&mut |ev| {
            if let StreamEvent::Gap { offset, len, .. } = ev.kind {
                gaps.push((ev.connection.0, ev.direction, offset, len));
            }
        });
        assert_eq!(gaps, [(0, Direction::FromClient, 0, 3)]);
    }
}
