//! The stream protocol carried in iWARP Sends: an 8-byte header on every message and the
//! hello in the MPA private data. Pure encoding and decoding, no I/O.
//!
//! ```text
//! message:      type (1) | 0 (1) | grant (2, big-endian) | 0 (4) | body
//! DATA          body: the stream's bytes
//! GRANT         no body: returns `grant` receive slots
//! EOF           no body: the sender shut down its sending side (after its last DATA)
//! WINDOW        body: offset (8) | addr (8) | STag (4) | len (8): a window the peer may
//!               RDMA Write and Read, addressed by `offset .. offset + len`
//! WROTE         body: offset (8) | len (8): the sender RDMA Wrote these window bytes
//!               (delivered after the Write's bytes are placed)
//! hello (MPA private data, both directions):
//!               "SWSK" | version 1 (1) | 0 (3) | receive slots (4) | slot size (4)
//! ```

/// Bytes of the header of every message.
pub const HEADER_LEN: usize = 8;
/// Bytes of the hello in the MPA private data.
pub const HELLO_LEN: usize = 16;
const MAGIC: &[u8; 4] = b"SWSK";
const VERSION: u8 = 1;

/// The kind of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Stream bytes.
    Data,
    /// Credits only.
    Grant,
    /// End of the sender's stream.
    Eof,
    /// A window advertisement.
    Window,
    /// A notice of an RDMA Write into a window.
    Wrote,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Data => 1,
            Kind::Grant => 2,
            Kind::Eof => 3,
            Kind::Window => 4,
            Kind::Wrote => 5,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Kind::Data,
            2 => Kind::Grant,
            3 => Kind::Eof,
            4 => Kind::Window,
            5 => Kind::Wrote,
            _ => return None,
        })
    }
}

/// A malformed message or hello from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

/// The header of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Its kind.
    pub kind: Kind,
    /// Receive slots it returns.
    pub grant: u16,
}

impl Header {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let g = self.grant.to_be_bytes();
        [self.kind.code(), 0, g[0], g[1], 0, 0, 0, 0]
    }

    /// Parses the header at the start of `msg`; the body follows.
    pub fn decode(msg: &[u8]) -> Result<(Header, &[u8]), Malformed> {
        let (h, body) = msg
            .split_at_checked(HEADER_LEN)
            .ok_or(Malformed("message shorter than its header"))?;
        let kind = Kind::from_code(h[0]).ok_or(Malformed("unknown message type"))?;
        let grant = u16::from_be_bytes([h[2], h[3]]);
        let expect_body = match kind {
            Kind::Data => None,
            Kind::Grant | Kind::Eof => Some(0),
            Kind::Window => Some(WINDOW_LEN),
            Kind::Wrote => Some(WROTE_LEN),
        };
        if expect_body.is_some_and(|n| n != body.len()) {
            return Err(Malformed("control message with a wrong length"));
        }
        Ok((Header { kind, grant }, body))
    }
}

/// Body bytes of a WINDOW message.
pub const WINDOW_LEN: usize = 28;
/// Body bytes of a WROTE message.
pub const WROTE_LEN: usize = 16;

/// A window as advertised: the peer addresses `offset .. offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowAd {
    /// Where the window starts in the peer's offset space.
    pub offset: u64,
    /// Its tagged address (RDMA Writes and Reads use `addr + (o - offset)`).
    pub addr: u64,
    /// Its STag.
    pub stag: u32,
    /// Its length.
    pub len: u64,
}

impl WindowAd {
    /// The WINDOW body.
    pub fn encode(&self) -> [u8; WINDOW_LEN] {
        let mut b = [0u8; WINDOW_LEN];
        b[..8].copy_from_slice(&self.offset.to_be_bytes());
        b[8..16].copy_from_slice(&self.addr.to_be_bytes());
        b[16..20].copy_from_slice(&self.stag.to_be_bytes());
        b[20..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Parses a WINDOW body (its length was checked by [`Header::decode`]).
    pub fn decode(b: &[u8]) -> Result<Self, Malformed> {
        let b: &[u8; WINDOW_LEN] = b.try_into().map_err(|_| Malformed("WINDOW length"))?;
        let ad = Self {
            offset: u64_at(b, 0),
            addr: u64_at(b, 8),
            stag: u32::from_be_bytes([b[16], b[17], b[18], b[19]]),
            len: u64_at(b, 20),
        };
        if ad.offset.checked_add(ad.len).is_none() {
            return Err(Malformed("window past the end of the offset space"));
        }
        Ok(ad)
    }

    /// The tagged address of `[offset, offset + len)` if the window holds all of it.
    pub fn locate(&self, offset: u64, len: u64) -> Option<u64> {
        let rel = offset.checked_sub(self.offset)?;
        let end = rel.checked_add(len)?;
        (end <= self.len).then(|| self.addr.wrapping_add(rel))
    }
}

/// The WROTE body.
pub fn encode_wrote(offset: u64, len: u64) -> [u8; WROTE_LEN] {
    let mut b = [0u8; WROTE_LEN];
    b[..8].copy_from_slice(&offset.to_be_bytes());
    b[8..].copy_from_slice(&len.to_be_bytes());
    b
}

/// Parses a WROTE body.
pub fn decode_wrote(b: &[u8]) -> Result<(u64, u64), Malformed> {
    if b.len() != WROTE_LEN {
        return Err(Malformed("WROTE length"));
    }
    Ok((u64_at(b, 0), u64_at(b, 8)))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(at..at.saturating_add(8)) {
        w.copy_from_slice(s);
    }
    u64::from_be_bytes(w)
}

/// What each end says about itself in the MPA private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Receive slots it posted.
    pub slots: u32,
    /// Bytes of each slot (header included).
    pub slot_size: u32,
}

impl Hello {
    /// The private data bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HELLO_LEN);
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&[VERSION, 0, 0, 0]);
        v.extend_from_slice(&self.slots.to_be_bytes());
        v.extend_from_slice(&self.slot_size.to_be_bytes());
        v
    }

    /// Parses the peer's private data.
    pub fn decode(b: &[u8]) -> Result<Self, Malformed> {
        if b.len() < HELLO_LEN || &b[..4] != MAGIC {
            return Err(Malformed(
                "the peer is not a softwarp-sockets peer (no hello in the MPA private data)",
            ));
        }
        if b[4] != VERSION {
            return Err(Malformed("unknown softwarp-sockets version"));
        }
        let h = Self {
            slots: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            slot_size: u32::from_be_bytes([b[12], b[13], b[14], b[15]]),
        };
        if h.slots < crate::credits::MIN_SLOTS || (h.slot_size as usize) <= HEADER_LEN {
            return Err(Malformed(
                "the peer's receive slots are too few or too small",
            ));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header {
            kind: Kind::Data,
            grant: 513,
        };
        let mut msg = h.encode().to_vec();
        msg.extend_from_slice(b"abc");
        assert_eq!(Header::decode(&msg), Ok((h, &b"abc"[..])));
        assert!(Header::decode(&msg[..7]).is_err());
        msg[0] = 99;
        assert!(Header::decode(&msg).is_err());
        let mut eof = Header {
            kind: Kind::Eof,
            grant: 0,
        }
        .encode()
        .to_vec();
        assert!(Header::decode(&eof).is_ok());
        eof.push(0);
        assert!(Header::decode(&eof).is_err(), "EOF with a body");
    }

    #[test]
    fn window_locates_only_inside() {
        let w = WindowAd {
            offset: 1000,
            addr: 0x5000,
            stag: 7,
            len: 100,
        };
        assert_eq!(WindowAd::decode(&w.encode()), Ok(w));
        assert_eq!(w.locate(1000, 100), Some(0x5000));
        assert_eq!(w.locate(1050, 10), Some(0x5000 + 50));
        assert_eq!(w.locate(999, 1), None);
        assert_eq!(w.locate(1050, 51), None);
        assert_eq!(w.locate(u64::MAX, 2), None);
        let bad = WindowAd {
            offset: u64::MAX,
            len: 2,
            ..w
        };
        assert!(WindowAd::decode(&bad.encode()).is_err());
    }

    #[test]
    fn hello_round_trips_and_rejects_other_peers() {
        let h = Hello {
            slots: 16,
            slot_size: 65536,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        assert!(Hello::decode(b"").is_err());
        assert!(Hello::decode(&[0u8; 16]).is_err());
        let tiny = Hello { slots: 2, ..h };
        assert!(Hello::decode(&tiny.encode()).is_err());
    }
}
