//! What keeps a device available and says when it is not: the in-flight count of its entry
//! points ([`inflight`]), the checks that refuse a blocking call where it would deadlock
//! ([`context`]), structure markers ([`markers`]), the device's health with fault
//! containment and recovery ([`recovery`]) and the network interface watcher ([`netwatch`]).

pub(crate) mod context;
pub(crate) mod inflight;
pub(crate) mod markers;
pub(crate) mod netwatch;
pub mod recovery;
