//! rsocket's iomap windows (`riomap`, `riounmap`, `riowrite`), as rsocket.c has them: a
//! socket maps a buffer of its own for the peer to write (`PROT_WRITE`); the mapping (its
//! offset and an `rs_sge` naming the registration) is written into the peer's iomap table,
//! the entries after its target SGL, by an RDMA Write followed by an `RS_OP_IOMAP_SGL`
//! message with the entry's index; the peer's `riowrite` then RDMA-Writes straight into the
//! mapped buffer at `offset - mapping offset`, with no message (the application learns of
//! the data from its own protocol, as riostream's poll byte).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::time::Duration;

use softwarp::{AccessFlags, MemoryRegion};

use super::wire::{self, RsSge};

/// How long `riounmap`/`rclose` wait for work that validated a mapping before to finish with
/// its memory (the caller may free it once they return).
pub const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// One mapping of this end (`struct rs_iomap_mr`).
pub struct IomapMr {
    /// The offset the peer addresses it by.
    pub offset: u64,
    pub mr: MemoryRegion,
    /// The mapped buffer (for `riounmap`).
    pub addr: usize,
    pub len: usize,
    /// Its entry in the peer's table; `None` for a mapping the peer may not write.
    pub index: Option<usize>,
}

/// The mappings of a socket.
#[derive(Default)]
pub struct Iomaps {
    /// Sent to the peer (or local).
    pub list: Vec<IomapMr>,
    /// Waiting to be sent at the next `rsend`/`riowrite`.
    pub queue: VecDeque<IomapMr>,
    /// Which of the peer's table entries are taken.
    pub used: Vec<bool>,
}

impl Iomaps {
    /// A free entry of the peer's table of `entries`.
    pub fn free_index(&mut self, entries: usize) -> Option<usize> {
        if self.used.len() != entries {
            self.used.resize(entries, false);
        }
        let i = self.used.iter().position(|u| !u)?;
        self.used[i] = true;
        Some(i)
    }

    /// Takes the mapping of exactly `addr`, `len` out (`riounmap`'s search: sent ones
    /// first, then queued ones), giving its entry back.
    pub fn take(&mut self, addr: usize, len: usize) -> Option<IomapMr> {
        let hit = |m: &IomapMr| m.addr == addr && m.len == len;
        let m = if let Some(i) = self.list.iter().position(hit) {
            self.list.remove(i)
        } else {
            let i = self.queue.iter().position(hit)?;
            self.queue.remove(i)?
        };
        if let Some(i) = m.index {
            if let Some(u) = self.used.get_mut(i) {
                *u = false;
            }
        }
        Some(m)
    }

    /// Every mapping, for closing.
    pub fn drain(&mut self) -> Vec<IomapMr> {
        self.used.clear();
        self.list.drain(..).chain(self.queue.drain(..)).collect()
    }
}

/// `struct rs_iomap` as sent: offset, then the `rs_sge` (native order, or swapped for a
/// peer of the other byte order).
pub fn iomap_bytes(offset: u64, sge: RsSge, swap: bool) -> [u8; wire::IOMAP_LEN] {
    let mut b = [0u8; wire::IOMAP_LEN];
    let o = if swap { offset.swap_bytes() } else { offset };
    b[..8].copy_from_slice(&o.to_ne_bytes());
    b[8..].copy_from_slice(&sge.to_bytes(swap));
    b
}

/// An entry of our iomap table as the peer wrote it (in our order).
pub fn iomap_from_bytes(b: &[u8; wire::IOMAP_LEN]) -> (u64, RsSge) {
    let mut o = [0u8; 8];
    o.copy_from_slice(&b[..8]);
    let mut s = [0u8; wire::SGE_LEN];
    s.copy_from_slice(&b[8..]);
    (u64::from_ne_bytes(o), RsSge::from_bytes(&s))
}

/// The access of a mapping: `PROT_WRITE` lets the peer write it.
pub fn access(prot: c_int) -> Result<(AccessFlags, bool), c_int> {
    if prot & !(libc::PROT_WRITE | libc::PROT_NONE) != 0 {
        return Err(libc::EINVAL);
    }
    let remote = prot & libc::PROT_WRITE != 0;
    let mut a = AccessFlags::LOCAL_WRITE;
    if remote {
        a |= AccessFlags::REMOTE_WRITE;
    }
    Ok((a, remote))
}

/// Deregisters `m` and waits (bounded) until no work uses its memory any more.
pub fn release(m: IomapMr) {
    let r = m.mr.deregister();
    if let Err(e) = r.wait(RELEASE_WAIT) {
        tracing::warn!(target: "softwarp::verbs", error = %e, "riounmap: the mapping is still in use");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iomap_entries_are_offset_then_sge_in_24_bytes() {
        let sge = RsSge {
            addr: 0x1000,
            key: 7,
            length: 4096,
        };
        let b = iomap_bytes(0x40, sge, false);
        assert_eq!(iomap_from_bytes(&b), (0x40, sge));
        if !wire::HOST_IS_NET {
            assert_eq!(&b[..8], &[0x40, 0, 0, 0, 0, 0, 0, 0]);
            assert_eq!(&b[16..20], &[7, 0, 0, 0]);
        }
    }

    #[test]
    fn prot_other_than_write_or_none_is_refused() {
        assert_eq!(access(libc::PROT_READ).err(), Some(libc::EINVAL));
        assert!(access(libc::PROT_WRITE).expect("write").1);
        assert!(!access(libc::PROT_NONE).expect("none").1);
    }
}
