//! errno values as rdma-core reports them, and the trace record of every failed or
//! unsupported call.
//!
//! rdma-core has three conventions, and each entry point keeps the one of its C original:
//! `ibv_*` calls that return `int` return the errno value itself (`ibv_modify_qp`,
//! `ibv_post_send`, ...); calls that return a pointer return NULL and set `errno`; `rdma_*`
//! calls return -1 and set `errno`.

use softwarp::{Error, MpaError};
use softwarp_engine::qp::QpError;

/// The errno value rdma-core would give for `e`.
pub fn of(e: &Error) -> i32 {
    match e {
        Error::DeviceNotFound(_) => libc::ENODEV,
        Error::InvalidArgument(_) | Error::WrongOwner(_) => libc::EINVAL,
        Error::Limit { .. } => libc::ENOMEM,
        Error::Qp(QpError::QueueFull(_)) => libc::ENOMEM,
        Error::Qp(_) => libc::EINVAL,
        Error::Mr(_) | Error::Memory(_) | Error::Srq(_) => libc::EINVAL,
        Error::CqOverflowed { .. } => libc::EOVERFLOW,
        Error::AlreadyConnected | Error::NotIdle(_) => libc::EISCONN,
        Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        Error::Mpa(m) => match m {
            MpaError::Rejected { .. } => libc::ECONNREFUSED,
            MpaError::Timeout(_) => libc::ETIMEDOUT,
            MpaError::Closed => libc::ECONNRESET,
            MpaError::PrivateDataTooLong { .. } => libc::EINVAL,
            MpaError::Cancelled => libc::ECANCELED,
            _ => libc::ECONNREFUSED,
        },
        Error::Timeout(_) => libc::ETIMEDOUT,
        Error::DeviceStopped => libc::EIO,
        Error::NotConnected => libc::ENOTCONN,
        Error::ChannelClosed => libc::EBADF,
        Error::AlreadyAnswered => libc::EINVAL,
        Error::InUse { .. } => libc::EBUSY,
        _ => libc::EIO,
    }
}

/// Sets the thread's `errno`.
pub fn set(value: i32) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the
    // thread's lifetime.
    unsafe { *libc::__errno_location() = value };
}

/// Traces a failed call (level 2, component `verbs`) and returns its errno value.
pub fn fail(call: &'static str, e: &Error) -> i32 {
    let errno = of(e);
    tracing::debug!(target: "softwarp::verbs", call, errno, error = %e, "call failed");
    errno
}

/// Traces a call refused because Softwarp does not implement what it asks for, and returns
/// `EOPNOTSUPP`.
pub fn unsupported(call: &'static str, what: &'static str) -> i32 {
    tracing::warn!(target: "softwarp::verbs", call, what, "not supported by softwarp");
    libc::EOPNOTSUPP
}

/// Traces a call refused for a bad argument, and returns `EINVAL`.
pub fn invalid(call: &'static str, what: &'static str) -> i32 {
    tracing::debug!(target: "softwarp::verbs", call, what, "invalid argument");
    libc::EINVAL
}

/// Traces a destroy refused because other objects still use the object (`what` names
/// them), sets `errno` to `EBUSY` (rdma-core's providers leave the kernel's `EBUSY` there)
/// and returns it.
pub fn busy(call: &'static str, what: &'static str) -> i32 {
    tracing::debug!(target: "softwarp::verbs", call, what, "object still in use");
    set(libc::EBUSY);
    libc::EBUSY
}
