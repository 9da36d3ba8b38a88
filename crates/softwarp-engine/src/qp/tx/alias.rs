//! The alias lead-in of the transmit path: a large message whose payload would hit 4 KiB
//! aliasing in the kernel's copy into the socket starts with a few short FPDUs that move
//! the copy's source-to-destination distance out of the aliasing window ([`alias_lead`]
//! says why and how; measurements in BENCHMARKS.md). A segmentation choice only: DDP
//! allows any, and the bytes of the message are the same. No I/O here.

use crate::mr::Validated;
use crate::qp::COALESCE_MAX;

use super::TxState;

impl TxState {
    /// The payload cap of the FPDU at message offset `sent` of a message of `len` bytes
    /// sent from `src` with `hdr_len`-byte headers and at most `max` payload bytes per
    /// FPDU, when it is one of the short FPDUs leading the message ([`alias_lead`]; not
    /// with markers, or when turned off). Not either when the connection's FPDUs are no
    /// longer than [`COALESCE_MAX`] (MSS-sized, say): a runtime copies those into its batch,
    /// so the kernel copies from the batch, not from `src`, and a short leading FPDU (left
    /// to the gather path) would only take the FPDUs after it into a gathered write.
    pub(super) fn alias_cap(
        &self,
        src: &Validated,
        hdr_len: usize,
        len: u64,
        sent: u64,
        max: usize,
    ) -> Option<usize> {
        if !self.alias_lead || self.markers || self.max_fpdu <= COALESCE_MAX {
            return None;
        }
        let addr = src
            .memory
            .region()
            .addr()
            .wrapping_add(src.region_offset as u64);
        alias_lead(addr, hdr_len, len, sent, max).map(|lead| lead.min(max))
    }
}

/// Messages shorter than this are never led in ([`alias_lead`]). Measured on loopback,
/// ping-pong, CRC off (BENCHMARKS.md), in the VM's two states: at 64 KiB 17.2 us against
/// 22.9 with the lead-in when the copies are slow, even (10.5-10.9) when they are fast; at
/// 128 KiB 23 against 34 us; at 16-32 KiB it cost 0.5-1 us in the fast state (the
/// receiver handles the short FPDUs and copies what follows them through its staging
/// buffer).
pub(super) const ALIAS_LEAD_MIN_LEN: u64 = 64 << 10;

/// Source-to-destination distances (modulo 4 KiB) that [`alias_lead`] moves the payload
/// out of: the kernel's `rep movsb` copy into the socket's page fragment runs at about half
/// speed when the destination is less than a cache line ahead of the source modulo 4 KiB
/// (`scripts/alias-copy.c`, distance by distance: a 64 KiB send call took 13.7-15.9 us at
/// 1 to 63 bytes, 9.0-9.3 us at 0 and from 64 on; BENCHMARKS.md).
const ALIAS_WINDOW: u64 = 64;

/// The most FPDUs a message is led in with ([`alias_lead`]): past that the message is
/// far from the window and wraps into it only near its end, not worth a dozen FPDUs.
const ALIAS_LEAD_MAX_FPDUS: u64 = 8;

/// The most payload bytes the leading FPDUs carry together, and so the message offset
/// past which an FPDU is never a leading one. A message's last FPDU, when it would carry
/// this much or less (a page-aligned 64 KiB Send's 19 bytes after a full FPDU of 65,517,
/// a Write's 15, 1 MiB's 304 or 240), is carried by the leading FPDUs instead, one FPDU
/// fewer for both ends to build and handle (BENCHMARKS.md). Small, because the leading
/// payloads are copied in the aliasing window themselves.
pub(super) const ALIAS_LEAD_MAX_BYTES: u64 = 512;

/// The payload of the leading FPDU that starts at message offset `sent` of a message of
/// `len` bytes whose payload starts at address `addr`, whose FPDUs carry `hdr_len`-byte
/// DDP/RDMAP headers and at most `max_payload` payload bytes, when the message is led in
/// with short FPDUs; `None` for a normal FPDU.
///
/// Why: the kernel copies a `sendmsg` into the sending thread's page fragment, which
/// starts over at offset 0 once the previous messages were consumed (a ping-pong). The
/// first payload byte then lands at offset `2 + hdr_len` (MPA length and headers before
/// it), and from a page-aligned buffer (most applications' and perftest's) the
/// destination is 16 or 20 bytes ahead of the source modulo 4 KiB: every load of the copy
/// then waits on a store to an address with the same low 12 bits (4 KiB aliasing), and a
/// 64 KiB Send's `sendmsg` took 15.5 us against 8.2 us for the same bytes from a buffer
/// 20 bytes further on. Only framing bytes move the distance (payload bytes advance both
/// sides alike): each FPDU boundary moves it by the CRC, the pad and the next header, so
/// the FPDUs of a message step through the distances from the first one up. When one of
/// them would fall inside [`ALIAS_WINDOW`], short leading FPDUs move the first one to the
/// window's end, from where the rest stay clear (up to about 150 full FPDUs, 9 MiB).
/// Each carries one payload byte and three of pad (the largest step a boundary can make:
/// 27 bytes for a Send, 23 for a Write, so the fewest FPDUs do it: a page-aligned Send
/// takes two, a Write three), except that the last of them also carries what would have
/// been the message's short last FPDU ([`ALIAS_LEAD_MAX_BYTES`]) when the distance stays
/// clear with its pad. DDP allows any segmentation; the peer sees a few more FPDUs.
fn alias_lead(addr: u64, hdr_len: usize, len: u64, sent: u64, max_payload: usize) -> Option<usize> {
    if len < ALIAS_LEAD_MIN_LEN || max_payload == 0 || sent >= ALIAS_LEAD_MAX_BYTES {
        return None;
    }
    let max = max_payload as u64;
    let framing = 2 + hdr_len as u64;
    let step = |payload: u64| (4 - (framing + payload) % 4) % 4 + 4 + framing;
    // Where the first payload byte lands, minus where it comes from, modulo 4 KiB.
    let first = framing.wrapping_sub(addr) % 4096;
    // How far the full FPDUs after the first move it.
    let full = len.div_ceil(max).saturating_sub(1);
    let span = full.saturating_mul(step(max));
    // Clear already, or too long to keep clear from any start.
    if (first >= ALIAS_WINDOW && first + span < 4096) || span >= 4096 - ALIAS_WINDOW {
        return None;
    }
    let fpdus = ((ALIAS_WINDOW + 4096 - first) % 4096).div_ceil(step(1));
    if fpdus > ALIAS_LEAD_MAX_FPDUS {
        return None;
    }
    // The last leading FPDU takes the short tail too when its pad keeps the distance
    // clear: the others carry a byte each.
    let tail = len % max;
    let last = tail.saturating_sub(fpdus - 1);
    let folded = (fpdus..=ALIAS_LEAD_MAX_BYTES).contains(&tail)
        && (first + (fpdus - 1) * step(1) + step(last)) % 4096 >= ALIAS_WINDOW;
    let last = if folded { last } else { 1 };
    if sent < fpdus - 1 {
        Some(1)
    } else {
        (sent == fpdus - 1).then_some(last as usize)
    }
}
