//! Shared pieces: loopback socket pairs, process CPU time, medians, the polling pause and
//! the load average.

use std::io;
use std::net::{TcpListener, TcpStream};

/// A connected loopback TCP pair with TCP_NODELAY on both ends: (client, server).
pub fn tcp_pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    Ok((client, server))
}

/// User + system CPU seconds of the whole process so far (every thread, including io_uring's
/// SQPOLL and io-wq threads, which belong to the process), from getrusage(RUSAGE_SELF).
pub fn process_cpu_seconds() -> io::Result<f64> {
    // SAFETY: `rusage` is plain old data; all-zero is a valid value and getrusage overwrites it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the duration of the call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok(tv(ru.ru_utime) + tv(ru.ru_stime))
}

/// Median of a non-empty slice (sorts it); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// How every polling loop here waits after an empty poll: spin, and give the core away every
/// 32nd time, as `softwarp bench` does (`--yield-every 32`), so that two spinners that share
/// one of the two cores do not wait for a scheduler tick.
pub fn pause(spins: u32) {
    if spins.is_multiple_of(32) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// The 1-minute load average, as printed in /proc/loadavg.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// An `io::Error` with a message, for results the kernel should never produce.
pub fn protocol_error(msg: String) -> io::Error {
    io::Error::other(msg)
}
