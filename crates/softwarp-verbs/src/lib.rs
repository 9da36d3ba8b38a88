//! Drop-in `libibverbs.so.1` and `librdmacm.so.1` over Softwarp: unmodified rdma-core
//! programs (`ibv_devinfo`, `rping`, perftest, ...) run on Softwarp's user-space iWARP stack
//! with no kernel module.
//!
//! # One library, two names
//!
//! The crate builds one shared object with the soname `libibverbs.so.1` that exports both
//! libraries' symbols, each at its rdma-core v44 version (`IBVERBS_1.0`..`IBVERBS_1.14`,
//! `IBVERBS_PRIVATE_34`, `RDMACM_1.0`..`RDMACM_1.3`; see [`exports`]). `librdmacm.so.1` is a
//! second name (symbolic link) for the same file. Both must share one Rust runtime: an
//! `ibv_pd` made by `ibv_alloc_pd` goes into `rdma_create_qp`, a CQ of one into a QP of the
//! other, and Softwarp's objects (a device with its progress thread, the CM's channels) may
//! not be duplicated in two copies of the library with two sets of statics. The dynamic
//! loader identifies a library by its file (device and inode): when a program needs
//! `libibverbs.so.1` and `librdmacm.so.1` and both names lead to this file, it loads it once
//! and checks both names' version requirements against it. `softwarp exec` (and the tests)
//! make a directory with the two links and put it on `LD_LIBRARY_PATH`.
//!
//! # Layout
//!
//! [`ffi`] holds the structures of rdma-core's headers, generated once by bindgen (the
//! command is in its header). Every C object is a `repr(C)` Rust structure whose first
//! member is the C structure the application sees, followed by Softwarp's object
//! (`ibv_pd` → `Pd`, `ibv_qp_ex` → `Qp`, ...); a device context is rdma-core's
//! `verbs_context` (the `ibv_context` is its last member) followed by the `Device`. The
//! inline functions of `verbs.h` call through `ibv_context.ops` (`post_send`, `post_recv`,
//! `poll_cq`, `req_notify_cq`, `post_srq_recv`), `verbs_context` (`query_port`,
//! `query_device_ex`, `create_qp_ex`) and `ibv_qp_ex` (`ibv_wr_*`): all are filled.
//!
//! # Host devices
//!
//! [`host`] loads the host's own rdma-core beside Softwarp (`dlmopen`, a namespace of its
//! own) and lists its devices after `softwarp0`; the calls on a host device's objects go to
//! the host's library, and their data path to its provider, untouched.
//!
//! # Errors
//!
//! Each call fails as its rdma-core original does ([`errno`]): NULL or -1 with `errno`, or the
//! errno value as the return code. Bad arguments never crash what can be checked (NULL
//! pointers, unknown flags, sizes); the objects themselves must be the library's own, as
//! with rdma-core. What Softwarp does not implement (UD, address handles, multicast, memory
//! windows, resizing, ...) fails with `EOPNOTSUPP` (`ENOSYS` for CM calls) and a trace
//! record (target `softwarp::verbs`) naming the call.
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod caller;
pub mod cm;
pub mod env;
pub mod errno;
pub mod exports;
pub mod ffi;
pub mod host;
mod private;
pub mod rsocket;
pub mod verbs;
pub mod watch;
