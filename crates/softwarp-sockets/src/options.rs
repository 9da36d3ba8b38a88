//! Settings of iWARP mode, the process's default device, and the socket option numbers
//! (also in the crate's `include/softwarp_sockets.h` for C programs).

use std::io;
use std::sync::Mutex;
use std::time::Duration;

use softwarp::{CrcMode, Device};

/// `setsockopt` level of Softwarp's socket options (`SOL_SOFTWARP` in the C header). Linux's
/// own levels are below 300; this one is "SW" in ASCII.
pub const SOL_SOFTWARP: i32 = 0x5357;
/// Option (an `int`, 0 or 1) that switches a socket into iWARP mode; set before `connect` or
/// `listen` (`SOFTWARP_IWARP_MODE` in the C header). `getsockopt` reads it back.
pub const SO_IWARP_MODE: i32 = 1;
/// Read-only option (an `int`): 1 while the connection runs over iWARP, 0 for plain TCP
/// (`SOFTWARP_IWARP_ACTIVE` in the C header).
pub const SO_IWARP_ACTIVE: i32 = 2;

/// How an iWARP-mode connection is set up. Memory per connection is
/// `(recv_slots + send_slots) * slot_size` bytes of registered buffers: 1 MiB by default.
#[derive(Debug, Clone)]
pub struct IwarpOptions {
    /// Receive slots posted (each one incoming message): the peer's credits. At least 4.
    pub recv_slots: u32,
    /// Send slots (messages in flight from here, and pieces of one-sided operations).
    /// At least 2.
    pub send_slots: u32,
    /// Bytes of each slot, the 8-byte message header included; a message carries at most
    /// the smaller of both ends' slot sizes less 8. 64 bytes to 16 MiB.
    pub slot_size: u32,
    /// CRC32c policy of the MPA connection.
    pub crc: CrcMode,
    /// Bound of the MPA exchange (and, for [`crate::Socket::connect`], of the TCP connect).
    pub connect_timeout: Duration,
    /// How long closing waits until the bytes written were handed to TCP.
    pub linger: Duration,
    /// The device; `None`: one device shared by the process, opened at first use.
    pub device: Option<Device>,
}

impl Default for IwarpOptions {
    fn default() -> Self {
        Self {
            recv_slots: 16,
            send_slots: 16,
            slot_size: 32 * 1024,
            crc: CrcMode::Preferred,
            connect_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(10),
            device: None,
        }
    }
}

impl IwarpOptions {
    /// Registered bytes of one connection's rings.
    pub fn memory_per_connection(&self) -> u64 {
        u64::from(self.recv_slots.saturating_add(self.send_slots))
            .saturating_mul(u64::from(self.slot_size))
    }

    pub(crate) fn check(&self) -> io::Result<()> {
        let bad = |why| Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        if self.recv_slots < crate::credits::MIN_SLOTS || self.recv_slots > 4096 {
            return bad("recv_slots must be 4 to 4096");
        }
        if self.send_slots < 2 || self.send_slots > 4096 {
            return bad("send_slots must be 2 to 4096");
        }
        if !(64..=16 << 20).contains(&self.slot_size) {
            return bad("slot_size must be 64 bytes to 16 MiB");
        }
        Ok(())
    }
}

static DEFAULT_DEVICE: Mutex<Option<Device>> = Mutex::new(None);

/// The device iWARP streams use when [`IwarpOptions::device`] is `None`: opened at first use
/// and kept for the life of the process (its progress thread moves every stream's bytes).
pub fn default_device() -> io::Result<Device> {
    let mut g = softwarp::sync::lock(&DEFAULT_DEVICE);
    if let Some(d) = g.as_ref() {
        return Ok(d.clone());
    }
    let d = Device::builder().open().map_err(crate::conn::io_err)?;
    *g = Some(d.clone());
    Ok(d)
}

/// In the child of a `fork`: forgets the parent's default device (its threads did not
/// survive the fork) without touching it, so that the next stream opens a new one. The
/// parent's streams in the child stay unusable.
pub fn forget_default_device_after_fork() {
    if let Ok(mut g) = DEFAULT_DEVICE.try_lock() {
        if let Some(d) = g.take() {
            std::mem::forget(d);
        }
    }
}
