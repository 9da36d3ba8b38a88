//! `rpoll` and `rselect` over rsockets and ordinary descriptors together, as rdma-core's:
//! each rsocket's readiness is computed from its state (data received, room to send,
//! connection progress, requests at a listener), and the process sleeps in `poll(2)` on
//! the descriptor that will wake it: the completion channel of a connected socket (its CQ
//! armed first), the CM channel of a connecting or listening one.

use std::ffi::c_int;
use std::os::fd::AsRawFd;
use std::time::Duration;

use softwarp_ras::deadline::Deadline;

use super::lookup;
use super::stream::{state::*, Rsocket, Until};
use crate::cm::err;

/// rdma-core's `wake_up_interval`: the longest sleep before every rsocket is looked at
/// again.
const WAKE_UP_INTERVAL_MS: c_int = 5000;

/// `rs_poll_rs`: the events of `events` that hold for `rs` now (completions processed,
/// without waiting).
fn revents(rs: &Rsocket, events: i16) -> i16 {
    if rs.udp.is_some() {
        return super::dgram::revents(rs, events);
    }
    let mut g = rs.lock();
    if g.state == LISTENING {
        Rsocket::drain_requests(&mut g);
        return if g.pending.is_empty() {
            0
        } else {
            events & libc::POLLIN
        };
    }
    if g.state & OPENING != 0 {
        let (ng, r) = rs.do_connect(g, true);
        g = ng;
        if r == Err(libc::EINPROGRESS) {
            return 0;
        }
    }
    if g.s.is_some()
        && (g.state & CONNECTED != 0 || g.state == DISCONNECTED || g.state & ERROR != 0)
    {
        let (ng, _) = rs.process(g, true, Until::Once);
        g = ng;
        let mut rev = 0;
        if events & libc::POLLIN != 0 && g.test(Until::Readable) {
            rev |= libc::POLLIN;
        }
        if events & libc::POLLOUT != 0 && g.s.as_ref().is_some_and(|s| s.can_send()) {
            rev |= libc::POLLOUT;
        }
        // Disconnected: hung up once the data received before the disconnection is read
        // (rdma-core says POLLHUP as soon as the message arrives; a program that stops at
        // POLLHUP, as rstream -T a does, would leave that data unread).
        let unread = g.s.as_ref().is_some_and(|s| s.have_rdata());
        if g.state & CONNECTED == 0 {
            if g.state != DISCONNECTED {
                rev |= libc::POLLERR;
            } else if !unread {
                rev |= libc::POLLHUP;
            }
        }
        return rev;
    }
    if g.state == CONNECT_ERROR {
        return (events & (libc::POLLIN | libc::POLLOUT)) | libc::POLLERR;
    }
    0
}

/// The descriptor to sleep on for `rs` (its CQ armed first when connected), or `None`
/// when arming found it ready.
fn arm(rs: &Rsocket, fallback: c_int) -> c_int {
    let mut g = rs.lock();
    if g.state & CONNECTED != 0 || g.state == DISCONNECTED {
        if let Some(s) = g.s.as_mut() {
            if !s.cq_armed && s.ep.cq.req_notify(false).is_ok() {
                s.cq_armed = true;
            }
            return s.ep.chan.as_raw_fd();
        }
    }
    match g.cm.as_ref() {
        Some(cm) if g.state == LISTENING || g.state & OPENING != 0 => cm.as_raw_fd(),
        _ => fallback,
    }
}

/// After a sleep: the completion event of a socket whose channel fired is taken.
fn consume(rs: &Rsocket) {
    let mut g = rs.lock();
    if g.waiting {
        return;
    }
    if let Some(s) = g.s.as_mut() {
        if s.ep.chan.try_get_cq_event().is_some() {
            s.cq_armed = false;
        }
    }
}

/// For a library that emulates `poll`, `select` and `epoll` over rsockets itself (the
/// preload library of `softwarp-sockets` with `SOFTWARP_SOCKETS_PROTOCOL=rsocket`), the
/// steps of one `rpoll` round for the rsocket numbered `fd`, in this order: [`watch`] (the
/// descriptor to sleep on, the CQ armed first), [`events`] (what holds now), the sleep,
/// and [`woken`] for a socket whose descriptor fired. `None`: `fd` is not an rsocket.
pub fn watch(fd: c_int) -> Option<c_int> {
    lookup(fd).map(|rs| if rs.udp.is_some() { -1 } else { arm(&rs, -1) })
}

/// The events of `events` that hold for the rsocket `fd` now (completions processed and
/// connection progress taken, without waiting): `rpoll`'s answer for it. See [`watch`].
pub fn events(fd: c_int, events: i16) -> Option<i16> {
    lookup(fd).map(|rs| revents(&rs, events))
}

/// After a sleep in which the descriptor [`watch`] gave for `fd` fired: its completion
/// event is taken (the CQ is armed again by the next [`watch`]).
pub fn woken(fd: c_int) {
    if let Some(rs) = lookup(fd) {
        consume(&rs);
    }
}

/// Counts that change whenever the rsocket `fd` may have become readable (a message
/// consumed or arrived, a state change) and writable (a send completed, a credit came):
/// what an edge-triggered epoll registration compares with its last report.
pub fn edges(fd: c_int) -> Option<(u64, u64)> {
    let rs = lookup(fd)?;
    let g = rs.lock();
    let state = u64::from(g.state);
    Some(match g.s.as_ref() {
        Some(s) => {
            let (rx, tx) = s.edge_counts();
            (rx ^ (state << 48), tx ^ (state << 48))
        }
        None => (state << 48 | g.pending.len() as u64, state << 48),
    })
}

/// One pass over every descriptor without sleeping (`rs_poll_check`).
fn check(fds: &mut [libc::pollfd]) -> c_int {
    let mut n = 0;
    for f in fds.iter_mut() {
        f.revents = match lookup(f.fd) {
            Some(rs) => revents(&rs, f.events),
            None => {
                let mut one = *f;
                one.revents = 0;
                // SAFETY: one pollfd of ours.
                unsafe { libc::poll(&mut one, 1, 0) };
                one.revents
            }
        };
        if f.revents != 0 {
            n += 1;
        }
    }
    n
}

/// `rpoll`.
pub fn rpoll(fds: &mut [libc::pollfd], timeout: c_int) -> c_int {
    let deadline =
        Deadline::from_timeout((timeout >= 0).then(|| Duration::from_millis(timeout as u64)));
    loop {
        let n = check(fds);
        if n > 0 || timeout == 0 {
            return n;
        }
        // Sleep on what will wake each descriptor.
        let socks: Vec<Option<std::sync::Arc<Rsocket>>> =
            fds.iter().map(|f| lookup(f.fd)).collect();
        let mut rfds: Vec<libc::pollfd> = fds
            .iter()
            .zip(&socks)
            .map(|(f, s)| match s {
                Some(rs) => libc::pollfd {
                    fd: arm(rs, -1),
                    events: libc::POLLIN,
                    revents: 0,
                },
                None => libc::pollfd {
                    fd: f.fd,
                    events: f.events,
                    revents: 0,
                },
            })
            .collect();
        // A completion that came before the arming did not signal: look once more.
        let n = check(fds);
        if n > 0 {
            return n;
        }
        let sleep = match deadline.remaining() {
            Some(left) => {
                if left.is_zero() {
                    return 0;
                }
                (left.as_millis().min(WAKE_UP_INTERVAL_MS as u128) as c_int).max(1)
            }
            None => WAKE_UP_INTERVAL_MS,
        };
        // SAFETY: our own array of `rfds.len()` entries.
        let r = unsafe { libc::poll(rfds.as_mut_ptr(), rfds.len() as libc::nfds_t, sleep) };
        if r < 0 {
            return -1;
        }
        for (rf, s) in rfds.iter().zip(&socks) {
            if let Some(rs) = s {
                if rf.revents != 0 {
                    consume(rs);
                }
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    if fds.is_null() && nfds > 0 {
        return err(libc::EFAULT);
    }
    let fds: &mut [libc::pollfd] = if nfds == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `nfds` entries.
        unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) }
    };
    rpoll(fds, timeout)
}

/// `rselect`: the sets turned into a poll list (rdma-core's `rs_select_to_poll`), `rpoll`,
/// and back.
#[no_mangle]
pub unsafe extern "C" fn swv_rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return err(libc::EINVAL);
    }
    // SAFETY: the caller's sets (NULL or valid fd_sets).
    let isset =
        |set: *mut libc::fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    let mut fds: Vec<libc::pollfd> = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        if isset(readfds, fd) {
            events |= libc::POLLIN;
        }
        if isset(writefds, fd) {
            events |= libc::POLLOUT;
        }
        if events != 0 || isset(exceptfds, fd) {
            fds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    // SAFETY: NULL or the caller's timeval.
    let ms = match unsafe { timeout.as_ref() } {
        None => -1,
        Some(t) => {
            (t.tv_sec.saturating_mul(1000) + t.tv_usec / 1000).clamp(0, c_int::MAX as i64) as c_int
        }
    };
    let r = rpoll(&mut fds, ms);
    for set in [readfds, writefds, exceptfds] {
        if !set.is_null() {
            // SAFETY: the caller's set.
            unsafe { libc::FD_ZERO(set) };
        }
    }
    if r <= 0 {
        return r;
    }
    let mut cnt = 0;
    for f in &fds {
        // Each `f.fd` came from the loop over `0..nfds` above, and `nfds` was checked to be at
        // most FD_SETSIZE: the bit each FD_SET sets lies inside an `fd_set`.
        if !readfds.is_null() && f.revents & (libc::POLLIN | libc::POLLHUP) != 0 {
            // SAFETY: `readfds` is the caller's fd_set (not NULL, checked); `f.fd` is in range.
            unsafe { libc::FD_SET(f.fd, readfds) };
            cnt += 1;
        }
        if !writefds.is_null() && f.revents & libc::POLLOUT != 0 {
            // SAFETY: `writefds` is the caller's fd_set (not NULL, checked); `f.fd` is in range.
            unsafe { libc::FD_SET(f.fd, writefds) };
            cnt += 1;
        }
        if !exceptfds.is_null() && f.revents & !(libc::POLLIN | libc::POLLOUT) != 0 {
            // SAFETY: `exceptfds` is the caller's fd_set (not NULL, checked); `f.fd` is in
            // range.
            unsafe { libc::FD_SET(f.fd, exceptfds) };
            cnt += 1;
        }
    }

    cnt
}
