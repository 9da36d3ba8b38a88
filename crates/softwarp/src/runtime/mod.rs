//! The runtime under the verbs objects: the device's progress thread ([`progress`]) and the
//! system calls on raw iovecs and file descriptors ([`sys`], the crate's `unsafe` code).

pub(crate) mod progress;
#[allow(unsafe_code)]
pub(crate) mod sys;
