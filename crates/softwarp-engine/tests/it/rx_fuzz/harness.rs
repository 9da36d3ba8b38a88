//! The receive-path fuzz harness (issue 17), shared by the proptest `tests/it/rx_fuzz.rs` and
//! the cargo-fuzz target `fuzz/fuzz_targets/engine_rx.rs` (which includes this file by
//! path), so both feed bytes to exactly the same QP.
//!
//! A connected QP (RTS, CRC and markers as the input's first byte says) with registered
//! memory of every kind a peer might aim at, each registration inside a larger buffer whose
//! bytes outside it are guards:
//! - `WRITE`: remote write and atomic rights (the peer may change any byte of it);
//! - `READ`: remote read only, `NONE`: no remote rights, `OTHER_PD`: every right in another
//!   protection domain (none of them may change);
//! - `RECV`: receive WRs whose SGEs leave gaps between them (only the SGE ranges may change).
//!
//! Arbitrary bytes go to `Qp::recv_from` exactly as the runtime calls it, cut into reads at
//! the sizes the input says, with and without the staging buffer. The checks: the engine
//! never panics and never reports a bug, and no byte outside the ranges above changed.
#![allow(dead_code)]

use std::sync::Arc;

use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, MrTable, PdId, SeededKeys, Stag};
use softwarp_engine::qp::{
    copy_around, copy_to_dest, Qp, QpConfig, ReadDest, ReadUntil, RecvEnd, RxEnv, StreamConfig,
    VectoredRead,
};
use softwarp_engine::wr::{RecvWr, SgList, Sge};

pub const PD: PdId = PdId(1);
pub const OTHER: PdId = PdId(2);
/// Guard bytes on each side of every registration.
pub const GUARD: usize = 256;
/// Registered length of each target.
pub const LEN: usize = 4096;
/// Receive WRs posted, and the SGEs of each inside its `SLOT` bytes of `RECV`.
pub const RECVS: usize = 8;
pub const SLOT: usize = 512;
pub const RECV_SGES: [(usize, usize); 2] = [(0, 100), (200, 200)];
/// The seed of the STag keys, so the fuzzer (and the proptest) can learn the STags.
pub const KEY_SEED: u64 = 7;
/// Where each target is mapped (its iova).
pub const IOVA: [u64; 4] = [0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000];

/// One guarded registration.
pub struct Guarded {
    pub region: Arc<Region>,
    pub stag: Stag,
    pub iova: u64,
    before: Vec<u8>,
}

impl Guarded {
    fn new(mrs: &mut MrTable, pd: PdId, len: usize, iova: u64, access: Access, seed: u8) -> Self {
        let total = GUARD + len + GUARD;
        let region = Arc::new(Region::new_zeroed(total).expect("region"));
        let before: Vec<u8> = (0..total)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        region.write_at(0, &before).expect("fill");
        let stag = mrs
            .register(pd, region.clone(), GUARD, len, Some(iova), access)
            .expect("register");
        Self {
            region,
            stag,
            iova,
            before,
        }
    }

    fn now(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.before.len()];
        self.region.read_at(0, &mut v).expect("read");
        v
    }

    /// The first byte outside `allowed` (offsets in the registration) that changed.
    pub fn changed_outside(&self, allowed: &[(usize, usize)]) -> Option<usize> {
        let now = self.now();
        (0..now.len()).find(|&i| {
            now[i] != self.before[i]
                && !allowed
                    .iter()
                    .any(|&(at, len)| i >= GUARD + at && i < GUARD + at + len)
        })
    }
}

/// The QP and its memory.
pub struct Target {
    pub qp: Qp,
    pub mrs: MrTable,
    pub write: Guarded,
    pub read: Guarded,
    pub none: Guarded,
    pub other_pd: Guarded,
    pub recv: Guarded,
}

/// The stream settings the first input byte selects: bit 0 CRC, bit 1 markers on receive,
/// bit 2 RFC 7306 off, bit 3 the peer's Terminate layout is siw's.
pub fn stream_config(b: u8) -> StreamConfig {
    let mut s = StreamConfig::for_mss(1460);
    s.crc = b & 1 != 0;
    s.markers_rx = b & 2 != 0;
    s.markers = s.markers_rx;
    s.rfc7306 = b & 4 == 0;
    s.ird = 4;
    s.ord = 4;
    s.tx_stream_offset = 0;
    s.rx_stream_offset = 0;
    s
}

impl Target {
    pub fn new(cfg: u8) -> Self {
        let mut qp = Qp::new(QpConfig {
            qp_num: 1,
            pd: PD,
            sq_depth: 16,
            rq_depth: 16,
            use_srq: false,
            max_ird: 4,
            max_ord: 4,
        });
        qp.establish(stream_config(cfg)).expect("establish");
        let mut mrs = MrTable::new(16, SeededKeys::new(KEY_SEED));
        let lw = Access::LOCAL_WRITE;
        let write = Guarded::new(
            &mut mrs,
            PD,
            LEN,
            IOVA[0],
            lw | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            1,
        );
        let read = Guarded::new(&mut mrs, PD, LEN, IOVA[1], Access::REMOTE_READ, 2);
        let none = Guarded::new(&mut mrs, PD, LEN, IOVA[2], lw, 3);
        let all = lw
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC
            | Access::REMOTE_INVALIDATE;
        let other_pd = Guarded::new(&mut mrs, OTHER, LEN, IOVA[3], all, 4);
        let recv = Guarded::new(&mut mrs, PD, RECVS * SLOT, 0x5000_0000, lw, 5);
        for i in 0..RECVS {
            let mut sgl = SgList::new();
            for (at, len) in RECV_SGES {
                sgl.push(Sge {
                    lkey: recv.stag,
                    addr: recv.iova + (i * SLOT + at) as u64,
                    length: len as u32,
                })
                .expect("sge");
            }
            qp.post_recv(RecvWr {
                wr_id: i as u64,
                sgl,
            })
            .expect("post_recv");
        }
        Self {
            qp,
            mrs,
            write,
            read,
            none,
            other_pd,
            recv,
        }
    }

    /// Feeds `data` through `recv_from`, each read cut to the next size from `cuts`
    /// (1..=256 bytes, cycling; every read whole when `cuts` is empty), staged or not.
    /// Panics on an engine bug or on a byte changed outside what the peer may write.
    pub fn feed(&mut self, data: &[u8], cuts: &[u8], staged: bool) {
        let mut stage = if staged {
            vec![0u8; 64 * 1024]
        } else {
            Vec::new()
        };
        let mut k = 0usize;
        let mut src = Cut {
            data,
            at: 0,
            piece: || {
                let n = cuts
                    .get(k % cuts.len().max(1))
                    .map_or(usize::MAX, |&c| usize::from(c) + 1);
                k = k.wrapping_add(1);
                n
            },
        };
        // Bounded: each round consumes bytes or ends.
        for _ in 0..data.len() + 2 {
            let mut budget = usize::MAX;
            let mut env = RxEnv {
                mrs: &mut self.mrs,
                srq: None,
            };
            let end = self.qp.recv_from(
                &mut src,
                &mut stage,
                &mut budget,
                ReadUntil::WouldBlock,
                &mut env,
            );
            // Completions and events are taken as the runtime takes them.
            while self.qp.poll_completion().is_some() {}
            while self.qp.poll_event().is_some() {}
            match end {
                RecvEnd::Bug(why) => panic!("engine bug: {why}"),
                RecvEnd::Failed(e) => panic!("the reader failed: {e}"),
                RecvEnd::Blocked if src.at < data.len() => {}
                _ => break,
            }
        }
        self.check();
    }

    /// No byte outside the permitted ranges changed.
    pub fn check(&self) {
        let whole = [(0, LEN)];
        assert_eq!(
            self.write.changed_outside(&whole),
            None,
            "a guard of WRITE changed"
        );
        for (name, g) in [
            ("READ", &self.read),
            ("NONE", &self.none),
            ("OTHER_PD", &self.other_pd),
        ] {
            assert_eq!(g.changed_outside(&[]), None, "{name} changed");
        }
        let sges: Vec<(usize, usize)> = (0..RECVS)
            .flat_map(|i| RECV_SGES.map(|(at, len)| (i * SLOT + at, len)))
            .collect();
        assert_eq!(
            self.recv.changed_outside(&sges),
            None,
            "RECV changed outside its SGEs"
        );
    }
}

/// A reader over bytes, at most `piece()` per read, then `WouldBlock`.
struct Cut<'a, F> {
    data: &'a [u8],
    at: usize,
    piece: F,
}

impl<F: FnMut() -> usize> VectoredRead for Cut<'_, F> {
    fn read_to(&mut self, dest: ReadDest<'_>, stage: &mut [u8]) -> std::io::Result<usize> {
        let rest = &self.data[self.at..];
        if rest.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = (self.piece)().clamp(1, rest.len());
        let got = copy_to_dest(&rest[..n], dest, stage)?;
        self.at += got;
        Ok(got)
    }

    fn read_around(
        &mut self,
        head: &mut [u8],
        dest: ReadDest<'_>,
        tail: &mut [u8],
    ) -> std::io::Result<usize> {
        let rest = &self.data[self.at..];
        if rest.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = (self.piece)().clamp(1, rest.len());
        let got = copy_around(&rest[..n], head, dest, tail)?;
        self.at += got;
        Ok(got)
    }
}

/// One fuzz input: byte 0 the stream settings, byte 1 staged or not and the number of cut
/// sizes that follow (low 5 bits), then the cut sizes, then the stream.
pub fn run_input(input: &[u8]) {
    let Some((&cfg, rest)) = input.split_first() else {
        return;
    };
    let Some((&mode, rest)) = rest.split_first() else {
        return;
    };
    let ncuts = usize::from(mode & 0x1f).min(rest.len());
    let (cuts, data) = rest.split_at(ncuts);
    let mut t = Target::new(cfg);
    t.feed(data, cuts, mode & 0x80 != 0);
}
