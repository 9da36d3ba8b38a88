//! Big-endian field access that never panics.
//!
//! Every wire view in this crate reads and writes its fields through these helpers. They
//! never index out of bounds: a read past the end of the buffer yields zero bytes and a write
//! past the end is dropped. Views only reach that case when built with `new_unchecked` over a
//! short buffer; after `new_checked` every field is in range.

/// Copies `N` bytes starting at `offset`, or returns zeros if they are not all present.
pub(crate) fn get<const N: usize>(buf: &[u8], offset: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = offset.checked_add(N).and_then(|end| buf.get(offset..end)) {
        out.copy_from_slice(src);
    }
    out
}

/// Writes `bytes` at `offset` if the buffer holds them all; otherwise writes nothing.
pub(crate) fn put<const N: usize>(buf: &mut [u8], offset: usize, bytes: [u8; N]) {
    if let Some(dst) = offset
        .checked_add(N)
        .and_then(|end| buf.get_mut(offset..end))
    {
        dst.copy_from_slice(&bytes);
    }
}

/// Reads one byte (zero if absent).
pub(crate) fn u8_at(buf: &[u8], offset: usize) -> u8 {
    buf.get(offset).copied().unwrap_or(0)
}

/// Writes one byte (dropped if out of range).
pub(crate) fn set_u8(buf: &mut [u8], offset: usize, value: u8) {
    if let Some(b) = buf.get_mut(offset) {
        *b = value;
    }
}

/// Reads a big-endian `u16`.
pub(crate) fn u16_at(buf: &[u8], offset: usize) -> u16 {
    u16::from_be_bytes(get(buf, offset))
}

/// Reads a big-endian `u32`.
pub(crate) fn u32_at(buf: &[u8], offset: usize) -> u32 {
    u32::from_be_bytes(get(buf, offset))
}

/// Reads a big-endian `u64`.
pub(crate) fn u64_at(buf: &[u8], offset: usize) -> u64 {
    u64::from_be_bytes(get(buf, offset))
}

/// Writes a big-endian `u16`.
pub(crate) fn set_u16(buf: &mut [u8], offset: usize, value: u16) {
    put(buf, offset, value.to_be_bytes());
}

/// Writes a big-endian `u32`.
pub(crate) fn set_u32(buf: &mut [u8], offset: usize, value: u32) {
    put(buf, offset, value.to_be_bytes());
}

/// Writes a big-endian `u64`.
pub(crate) fn set_u64(buf: &mut [u8], offset: usize, value: u64) {
    put(buf, offset, value.to_be_bytes());
}

/// The sub-slice `buf[from..]`, or an empty slice when `from` is past the end.
pub(crate) fn tail(buf: &[u8], from: usize) -> &[u8] {
    buf.get(from..).unwrap_or(&[])
}

/// The mutable sub-slice `buf[from..]`, or an empty slice when `from` is past the end.
pub(crate) fn tail_mut(buf: &mut [u8], from: usize) -> &mut [u8] {
    let start = from.min(buf.len());
    buf.get_mut(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn reads_past_the_end_give_zero_and_writes_are_dropped() {
        let mut buf = [0x12, 0x34, 0x56];
        assert_eq!(u16_at(&buf, 1), 0x3456);
        assert_eq!(u16_at(&buf, 2), 0);
        assert_eq!(u32_at(&buf, 0), 0);
        assert_eq!(u64_at(&buf, usize::MAX), 0);
        assert_eq!(u8_at(&buf, 3), 0);
        set_u32(&mut buf, 1, 0xffff_ffff);
        set_u16(&mut buf, usize::MAX, 1);
        set_u8(&mut buf, 9, 1);
        assert_eq!(buf, [0x12, 0x34, 0x56]);
        assert!(tail(&buf, 4).is_empty());
        assert!(tail_mut(&mut buf, 7).is_empty());
        assert_eq!(tail(&buf, 1), &[0x34, 0x56]);
    }
}
