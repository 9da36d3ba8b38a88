//! Streaming over loopback TCP: one sender thread writes `chunk`-byte writes, a plain reader
//! thread reads them with a 1 MiB buffer (blocking `read`). The sender is what varies.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::thread;
use std::time::Instant;

use io_uring::IoUring;

use crate::common::{process_cpu_seconds, protocol_error, tcp_pair};
use crate::ring::{has_more, is_notif, Buffers, Reap, RingEnd};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Blocking `write` (std's `write_all`).
    Write,
    /// IORING_OP_SEND with MSG_WAITALL, one submit_and_wait(1) per write.
    UringSend,
    /// IORING_OP_WRITE_FIXED from a registered buffer on a registered file, one
    /// submit_and_wait(1) per write.
    UringWriteFixed,
    /// IORING_OP_SEND_ZC with MSG_WAITALL from a registered buffer; each write waits for its
    /// result and its buffer-release notification before the buffer is reused.
    UringSendZc,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::Write,
        Variant::UringSend,
        Variant::UringWriteFixed,
        Variant::UringSendZc,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Variant::Write => "plain write (blocking)",
            Variant::UringSend => "io_uring send, submit_and_wait",
            Variant::UringWriteFixed => "io_uring write_fixed (reg. file+buf)",
            Variant::UringSendZc => "io_uring send_zc (reg. buf)",
        }
    }
}

/// One run.
pub struct Sample {
    pub gbit_s: f64,
    pub cpu_s_per_gib: f64,
    /// SEND_ZC notifications that reported the kernel copied the data anyway / all.
    pub zc_copied: u64,
    pub zc_notifs: u64,
}

pub fn run(variant: Variant, chunk: usize, total: u64) -> io::Result<Sample> {
    let (mut sender, receiver) = tcp_pair()?;
    let cpu0 = process_cpu_seconds()?;
    let t0 = Instant::now();
    let reader = thread::spawn(move || read_all(receiver, total));
    let sent = match variant {
        Variant::Write => plain_sender(&mut sender, chunk, total).map(|()| (0, 0)),
        Variant::UringSend | Variant::UringWriteFixed | Variant::UringSendZc => {
            uring_sender(variant, &sender, chunk, total)
        }
    };
    // On error, closing the socket ends the reader.
    drop(sender);
    let read = reader
        .join()
        .map_err(|_| protocol_error("reader thread panicked".to_owned()))?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds()? - cpu0;
    let (zc_copied, zc_notifs) = sent?;
    let got = read?;
    if got != total {
        return Err(protocol_error(format!("reader got {got} of {total} bytes")));
    }
    let gib = total as f64 / (1u64 << 30) as f64;
    Ok(Sample {
        gbit_s: total as f64 * 8.0 / secs / 1e9,
        cpu_s_per_gib: cpu / gib,
        zc_copied,
        zc_notifs,
    })
}

fn read_all(mut s: TcpStream, total: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    while got < total {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// A buffer of `chunk` bytes: 64-byte records numbered 0, 1, ... (only the content of the
/// message-rate shape matters to no one; it is filled once, as the bench's TCP baseline does).
fn pattern(chunk: usize) -> Vec<u8> {
    (0..chunk).map(|i| (i / 64) as u8).collect()
}

fn plain_sender(s: &mut TcpStream, chunk: usize, total: u64) -> io::Result<()> {
    let buf = pattern(chunk);
    let mut left = total;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        s.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// Returns (notifications reporting a copy, all notifications) for SEND_ZC, zeros otherwise.
fn uring_sender(
    variant: Variant,
    s: &TcpStream,
    chunk: usize,
    total: u64,
) -> io::Result<(u64, u64)> {
    let buffers = if variant == Variant::UringSend {
        Buffers::Plain
    } else {
        Buffers::Registered
    };
    let mut end = RingEnd::new(
        IoUring::new(64)?,
        s.as_raw_fd(),
        Reap::SubmitAndWait,
        buffers,
        chunk,
    )?;
    end.buf_mut().copy_from_slice(&pattern(chunk));
    /// IORING_NOTIF_USAGE_ZC_COPIED, set in a notification's result.
    const ZC_COPIED: i32 = i32::MIN;
    let (mut copied, mut notifs) = (0u64, 0u64);
    let mut left = total;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        let mut done = 0usize;
        while done < n {
            match variant {
                Variant::UringSendZc => end.push_send_zc(done, n - done, libc::MSG_WAITALL, 1)?,
                _ => end.push_send(done, n - done, libc::MSG_WAITALL, 1)?,
            }
            let mut pending_notifs = 0u32;
            let mut result = None;
            while result.is_none() || pending_notifs > 0 {
                let (_, res, flags) = end.next_cqe()?;
                if is_notif(flags) {
                    notifs += 1;
                    if res & ZC_COPIED != 0 {
                        copied += 1;
                    }
                    pending_notifs = pending_notifs.saturating_sub(1);
                } else {
                    if has_more(flags) {
                        pending_notifs += 1;
                    }
                    result = Some(res);
                }
            }
            let r = result.unwrap_or(0);
            if r <= 0 {
                return Err(protocol_error(format!("send completed with {r}")));
            }
            done += r as usize;
        }
        left -= n as u64;
    }
    Ok((copied, notifs))
}
