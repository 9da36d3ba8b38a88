//! Reading one MPA Request/Reply frame from a socket, exactly: the fixed header first, then
//! PD_Length octets, never a byte more, so the FPDUs that follow stay in the socket for the
//! QP. Works on blocking sockets (with a read timeout) and non-blocking ones alike; garbage
//! is refused as soon as the bytes seen rule out a frame.

use std::io::{self, Read, Write};

use softwarp_wire::mpa::frame::{MpaFrame, HEADER_LEN, MAX_PRIVATE_DATA_LEN};
use softwarp_wire::WireError;

/// The largest frame: header and 512 octets of private data.
pub(crate) const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_PRIVATE_DATA_LEN;

/// How a read attempt ended, short of an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// The frame is complete ([`FrameReader::bytes`]).
    Complete,
    /// The socket has nothing more for now (or, blocking, its read timeout passed).
    WouldBlock,
}

/// Why reading a frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The bytes seen cannot start a valid frame (bad key, revision, PD_Length).
    Wire(WireError),
    /// The peer closed the connection first.
    Closed,
    /// The socket failed.
    Io(io::Error),
}

/// Accumulates one frame.
#[derive(Debug)]
pub(crate) struct FrameReader {
    buf: Box<[u8; MAX_FRAME_LEN]>,
    have: usize,
}

impl FrameReader {
    pub(crate) fn new() -> Self {
        Self {
            buf: Box::new([0u8; MAX_FRAME_LEN]),
            have: 0,
        }
    }

    /// The bytes read so far (the whole frame once complete).
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.get(..self.have).unwrap_or_default()
    }

    /// Reads what the frame still needs from `r`, until it is complete or `r` would block.
    pub(crate) fn fill(&mut self, r: &mut impl Read) -> Result<Progress, ReadError> {
        loop {
            let need = MpaFrame::needed(self.bytes()).map_err(ReadError::Wire)?;
            if need == 0 {
                return Ok(Progress::Complete);
            }
            let Some(dst) = self.buf.get_mut(self.have..self.have + need) else {
                // `needed` never asks beyond HEADER_LEN + 512 (PD_Length is checked).
                return Err(ReadError::Wire(WireError::MpaPrivateDataTooLong(
                    self.have + need,
                )));
            };
            match r.read(dst) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(n) => self.have += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::TimedOut =>
                {
                    return Ok(Progress::WouldBlock)
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }
}

/// Writes `bytes[*written..]` to a non-blocking `w` as far as it takes them; true once all
/// are written.
pub(crate) fn write_some(
    w: &mut impl Write,
    bytes: &[u8],
    written: &mut usize,
) -> io::Result<bool> {
    loop {
        let Some(rest) = bytes.get(*written..).filter(|r| !r.is_empty()) else {
            return Ok(true);
        };
        match w.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out its bytes in chunks of `step`, then reports WouldBlock.
    struct Chunks<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl Read for Chunks<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.data.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = self.step.min(buf.len()).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn frame_with_fpdu() -> Vec<u8> {
        let mut v = b"MPA ID Rep Frame".to_vec();
        v.extend_from_slice(&[0x40, 1, 0, 3, b'a', b'b', b'c']);
        v.extend_from_slice(&[0, 2, 0xff, 0xff]); // the start of an FPDU
        v
    }

    #[test]
    fn reads_exactly_one_frame_in_any_chunking() {
        let data = frame_with_fpdu();
        for step in 1..=data.len() {
            let mut r = FrameReader::new();
            let mut src = Chunks { data: &data, step };
            let mut rounds = 0;
            loop {
                match r.fill(&mut src).unwrap() {
                    Progress::Complete => break,
                    Progress::WouldBlock => rounds += 1,
                }
                assert!(rounds < 2, "step {step}");
            }
            assert_eq!(r.bytes(), &data[..23], "step {step}");
            assert_eq!(src.data, &data[23..], "the FPDU stays unread");
        }
    }

    #[test]
    fn garbage_is_refused_at_the_first_wrong_byte() {
        let mut r = FrameReader::new();
        let mut src = Chunks {
            data: b"GET / HTTP/1.1\r\n",
            step: 1,
        };
        assert!(matches!(
            r.fill(&mut src),
            Err(ReadError::Wire(WireError::MpaBadKey))
        ));
        assert_eq!(r.bytes(), b"G", "nothing beyond the first octet was read");
        let mut long = b"MPA ID Req Frame".to_vec();
        long.extend_from_slice(&[0, 1, 2, 1]); // PD_Length 513
        let mut r = FrameReader::new();
        assert!(matches!(
            r.fill(&mut Chunks {
                data: &long,
                step: 64
            }),
            Err(ReadError::Wire(WireError::MpaPrivateDataTooLong(513)))
        ));
    }

    #[test]
    fn end_of_stream_before_the_frame_is_closed() {
        let mut r = FrameReader::new();
        let mut src: &[u8] = b"MPA ID";
        assert!(matches!(r.fill(&mut src), Err(ReadError::Closed)));
    }

    #[test]
    fn write_some_resumes_where_it_stopped() {
        struct Small(Vec<u8>, usize);
        impl Write for Small {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                if self.1 == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                let n = b.len().min(3);
                self.1 -= 1;
                self.0.extend_from_slice(&b[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut w = Small(Vec::new(), 2);
        let mut written = 0;
        assert!(!write_some(&mut w, b"0123456789", &mut written).unwrap());
        assert_eq!(written, 6);
        w.1 = 10;
        assert!(write_some(&mut w, b"0123456789", &mut written).unwrap());
        assert_eq!(w.0, b"0123456789");
    }
}
