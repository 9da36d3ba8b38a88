//! rdma-core's rsocket wire formats (librdmacm/rsocket.c, v44), sans I/O: the connection
//! data carried in the MPA private data, the 32-bit messages that iWARP carries as 4-byte
//! Sends (rdma-core's `RS_OPT_MSG_SEND`: there is no Write with Immediate on iWARP), and the
//! scatter/gather entries written into the peer's target SGL.
//!
//! Byte orders, as rsocket.c has them: the connection data is big-endian; a message is the
//! sender's native `uint32_t` (rsocket.c sends the variable's bytes, and reads the receive
//! buffer as a native `uint32_t`); an SGL entry is the sender's native layout, or the
//! receiver's when the two differ (the receiver's `RS_CONN_FLAG_NET` tells, and the sender
//! swaps: `RS_OPT_SWAP_SGL`).

/// `struct rs_conn_data.version`.
pub const VERSION: u8 = 1;
/// `RS_CONN_FLAG_NET`: the sender is big-endian.
pub const FLAG_NET: u8 = 1 << 0;
/// `RS_CONN_FLAG_IOMAP`: the sender's target buffer has iomap entries after its SGL.
pub const FLAG_IOMAP: u8 = 1 << 1;
/// `sizeof(struct rs_conn_data)`.
pub const CONN_DATA_LEN: usize = 40;
/// `sizeof(struct rs_sge)`.
pub const SGE_LEN: usize = 16;
/// `sizeof(struct rs_iomap)`.
pub const IOMAP_LEN: usize = 24;
/// `RS_SGL_SIZE`: entries in a target SGL.
pub const SGL_SIZE: usize = 2;
/// `RS_MSG_SIZE`: a message Send's payload.
pub const MSG_SIZE: usize = 4;

/// This host's `rs_host_is_net()`.
pub const HOST_IS_NET: bool = cfg!(target_endian = "big");

/// The message opcodes (bits 31..29 of a message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `RS_OP_DATA`: bytes written into the receive buffer.
    Data,
    /// `RS_OP_WRITE`: never sent (an iomap write's local completion).
    Write,
    /// `RS_OP_SGL`: receive credits, with a target SGL entry written or not.
    Sgl,
    /// `RS_OP_IOMAP_SGL`: an iomap entry was written.
    IomapSgl,
    /// `RS_OP_CTRL`: disconnect, keepalive, shutdown.
    Ctrl,
    /// The reserved codes 1, 3 and 5.
    Reserved(u8),
}

impl Op {
    /// The 3-bit code.
    pub fn code(self) -> u32 {
        match self {
            Op::Data => 0,
            Op::Write => 2,
            Op::Sgl => 4,
            Op::IomapSgl => 6,
            Op::Ctrl => 7,
            Op::Reserved(c) => u32::from(c & 7),
        }
    }

    fn from_code(c: u32) -> Op {
        match c & 7 {
            0 => Op::Data,
            2 => Op::Write,
            4 => Op::Sgl,
            6 => Op::IomapSgl,
            7 => Op::Ctrl,
            // `c & 7` is below 8.
            other => Op::Reserved(other as u8),
        }
    }
}

/// `RS_CTRL_DISCONNECT`.
pub const CTRL_DISCONNECT: u32 = 0;
/// `RS_CTRL_KEEPALIVE`.
pub const CTRL_KEEPALIVE: u32 = 1;
/// `RS_CTRL_SHUTDOWN`.
pub const CTRL_SHUTDOWN: u32 = 2;

/// `rs_msg_set(op, data)`.
pub fn msg(op: Op, data: u32) -> u32 {
    (op.code() << 29) | (data & 0x1FFF_FFFF)
}

/// `rs_msg_op(msg)`.
pub fn msg_op(m: u32) -> Op {
    Op::from_code(m >> 29)
}

/// `rs_msg_data(msg)`.
pub fn msg_data(m: u32) -> u32 {
    m & 0x1FFF_FFFF
}

/// A message as the bytes of its Send (native order, as rsocket.c sends it).
pub fn msg_bytes(m: u32) -> [u8; MSG_SIZE] {
    m.to_ne_bytes()
}

/// A message from the bytes of a received Send.
pub fn msg_from_bytes(b: [u8; MSG_SIZE]) -> u32 {
    u32::from_ne_bytes(b)
}

/// `struct rs_sge`: an address, a key and a length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RsSge {
    /// The buffer's address (the tagged offset of RDMA Writes into it).
    pub addr: u64,
    /// The buffer's STag.
    pub key: u32,
    /// Its length in bytes (in a target SGL description: the number of entries).
    pub length: u32,
}

impl RsSge {
    /// The entry in native order, or byte-swapped (`RS_OPT_SWAP_SGL`).
    pub fn to_bytes(self, swap: bool) -> [u8; SGE_LEN] {
        let (a, k, l) = if swap {
            (
                self.addr.swap_bytes(),
                self.key.swap_bytes(),
                self.length.swap_bytes(),
            )
        } else {
            (self.addr, self.key, self.length)
        };
        let mut b = [0u8; SGE_LEN];
        b[0..8].copy_from_slice(&a.to_ne_bytes());
        b[8..12].copy_from_slice(&k.to_ne_bytes());
        b[12..16].copy_from_slice(&l.to_ne_bytes());
        b
    }

    /// An entry in native order (as a peer wrote it into our target SGL).
    pub fn from_bytes(b: &[u8; SGE_LEN]) -> Self {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[0..8]);
        let mut k = [0u8; 4];
        k.copy_from_slice(&b[8..12]);
        let mut l = [0u8; 4];
        l.copy_from_slice(&b[12..16]);
        Self {
            addr: u64::from_ne_bytes(a),
            key: u32::from_ne_bytes(k),
            length: u32::from_ne_bytes(l),
        }
    }

    fn put_be(self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..12].copy_from_slice(&self.key.to_be_bytes());
        out[12..16].copy_from_slice(&self.length.to_be_bytes());
    }

    /// An entry in network order (`b` holds at least [`SGE_LEN`] bytes).
    fn get_be(b: &[u8]) -> Self {
        let mut raw = [0u8; SGE_LEN];
        raw.copy_from_slice(&b[..SGE_LEN]);
        let n = Self::from_bytes(&raw);
        Self {
            addr: u64::from_be(n.addr),
            key: u32::from_be(n.key),
            length: u32::from_be(n.length),
        }
    }
}

/// `struct rs_conn_data`, the MPA private data of the Request and of the Reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnData {
    /// Always [`VERSION`] when sent; a peer's other version is refused.
    pub version: u8,
    /// [`FLAG_NET`], [`FLAG_IOMAP`].
    pub flags: u8,
    /// Receive credits: the sender's receive queue size.
    pub credits: u16,
    /// The iomap size, scaled (`rs_value_to_scale(size, 8)`).
    pub target_iomap_size: u8,
    /// The sender's target SGL (its `length` is the number of entries, [`SGL_SIZE`]).
    pub target_sgl: RsSge,
    /// The first half of the sender's receive buffer.
    pub data_buf: RsSge,
}

/// Why a peer's connection data was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnDataError {
    /// Shorter than `struct rs_conn_data`.
    Short(usize),
    /// A version other than 1 (rdma-core refuses it too).
    Version(u8),
}

impl ConnData {
    /// The 40 bytes on the wire.
    pub fn to_bytes(self) -> [u8; CONN_DATA_LEN] {
        let mut b = [0u8; CONN_DATA_LEN];
        b[0] = self.version;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.credits.to_be_bytes());
        // b[4..7]: reserved, zero.
        b[7] = self.target_iomap_size;
        self.target_sgl.put_be(&mut b[8..24]);
        self.data_buf.put_be(&mut b[24..40]);
        b
    }

    /// The connection data at the start of `pd` (a longer private data is allowed: IB
    /// prefixes and padding are not ours to judge).
    pub fn parse(pd: &[u8]) -> Result<Self, ConnDataError> {
        if pd.len() < CONN_DATA_LEN {
            return Err(ConnDataError::Short(pd.len()));
        }
        if pd[0] != VERSION {
            return Err(ConnDataError::Version(pd[0]));
        }
        Ok(Self {
            version: pd[0],
            flags: pd[1],
            credits: u16::from_be_bytes([pd[2], pd[3]]),
            target_iomap_size: pd[7],
            target_sgl: RsSge::get_be(&pd[8..24]),
            data_buf: RsSge::get_be(&pd[24..40]),
        })
    }

    /// The peer's byte order differs from ours: SGL entries we write are swapped.
    pub fn needs_swap(&self) -> bool {
        (self.flags & FLAG_NET != 0) != HOST_IS_NET
    }
}

/// `rs_value_to_scale(value, bits)`.
pub fn value_to_scale(value: u32, bits: u32) -> u32 {
    let half = 1u32 << (bits - 1);
    if value <= half {
        value
    } else {
        half | (value >> bits)
    }
}

/// `rs_scale_to_value(value, bits)`.
pub fn scale_to_value(value: u32, bits: u32) -> u32 {
    let half = 1u32 << (bits - 1);
    if value <= half {
        value
    } else {
        (value & !half) << bits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The connection data of an rdma-core rsocket on x86-64 with the defaults (rq_size
    /// 384, 128 KiB receive buffer: the first half offered), written by hand from
    /// `rs_format_conn_data`: version 1, flags IOMAP, credits 384 big-endian, 3 reserved
    /// bytes, iomap size 0, then two big-endian `rs_sge`s (addr, key, length).
    const RDMA_CORE_REQ: [u8; 40] = [
        0x01, 0x02, 0x01, 0x80, 0x00, 0x00, 0x00, 0x00, // version flags credits rsvd iomap
        0x00, 0x00, 0x55, 0x55, 0x12, 0x34, 0x50, 0x00, // target_sgl.addr
        0x00, 0x00, 0x03, 0x01, // target_sgl.key
        0x00, 0x00, 0x00, 0x02, // target_sgl.length: RS_SGL_SIZE
        0x00, 0x00, 0x7f, 0xaa, 0xbb, 0xcc, 0x00, 0x10, // data_buf.addr
        0x00, 0x00, 0x04, 0x02, // data_buf.key
        0x00, 0x01, 0x00, 0x00, // data_buf.length: 64 KiB
    ];

    #[test]
    fn conn_data_decodes_rdma_cores_layout_and_encodes_it_back() {
        let c = ConnData::parse(&RDMA_CORE_REQ).expect("rdma-core's data");
        assert_eq!(c.version, 1);
        assert_eq!(c.flags, FLAG_IOMAP);
        assert_eq!(c.credits, 384);
        assert_eq!(c.target_iomap_size, 0);
        assert_eq!(
            c.target_sgl,
            RsSge {
                addr: 0x5555_1234_5000,
                key: 0x301,
                length: 2
            }
        );
        assert_eq!(
            c.data_buf,
            RsSge {
                addr: 0x7faa_bbcc_0010,
                key: 0x402,
                length: 65536
            }
        );
        assert!(!c.needs_swap() || HOST_IS_NET);
        assert_eq!(c.to_bytes(), RDMA_CORE_REQ);
    }

    #[test]
    fn conn_data_refuses_short_and_other_versions() {
        assert_eq!(
            ConnData::parse(&RDMA_CORE_REQ[..39]),
            Err(ConnDataError::Short(39))
        );
        let mut v2 = RDMA_CORE_REQ;
        v2[0] = 2;
        assert_eq!(ConnData::parse(&v2), Err(ConnDataError::Version(2)));
        // Trailing bytes (an MPA peer may pad) are ignored.
        let mut long = RDMA_CORE_REQ.to_vec();
        long.extend_from_slice(&[0xee; 8]);
        assert_eq!(ConnData::parse(&long).expect("padded data").credits, 384);
    }

    #[test]
    fn messages_pack_op_in_the_top_three_bits() {
        assert_eq!(msg(Op::Data, 5000), 5000);
        assert_eq!(msg(Op::Sgl, 768), 0x8000_0300);
        assert_eq!(msg(Op::Ctrl, CTRL_DISCONNECT), 0xE000_0000);
        assert_eq!(msg(Op::Ctrl, CTRL_SHUTDOWN), 0xE000_0002);
        assert_eq!(msg(Op::IomapSgl, 3), 0xC000_0003);
        assert_eq!(msg_op(0xE000_0002), Op::Ctrl);
        assert_eq!(msg_data(0xE000_0002), CTRL_SHUTDOWN);
        assert_eq!(msg_op(0x2000_0000), Op::Reserved(1));
        assert_eq!(msg(Op::Data, 0x3FFF_FFFF), 0x1FFF_FFFF);
        // On the wire: the native bytes of the uint32_t (little-endian on x86-64).
        if !HOST_IS_NET {
            assert_eq!(msg_bytes(0x8000_0300), [0x00, 0x03, 0x00, 0x80]);
        }
        assert_eq!(msg_from_bytes(msg_bytes(0xE000_0002)), 0xE000_0002);
    }

    #[test]
    fn sgl_entries_are_native_or_swapped_for_a_peer_of_the_other_order() {
        let s = RsSge {
            addr: 0x1122_3344_5566_7788,
            key: 0xaabb_ccdd,
            length: 0x0001_0000,
        };
        let native = s.to_bytes(false);
        assert_eq!(RsSge::from_bytes(&native), s);
        let swapped = s.to_bytes(true);
        let mut rev = native;
        rev[0..8].reverse();
        rev[8..12].reverse();
        rev[12..16].reverse();
        assert_eq!(swapped, rev);
    }

    #[test]
    fn iomap_sizes_round_as_rdma_core_scales_them() {
        for v in [0, 1, 64, 128] {
            assert_eq!(scale_to_value(value_to_scale(v, 8), 8), v);
        }
        // 300 is above 128: scaled to 128 | (300 >> 8) = 129, which is 256 back.
        assert_eq!(value_to_scale(300, 8), 129);
        assert_eq!(scale_to_value(129, 8), 256);
    }
}
