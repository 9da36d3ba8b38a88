//! The integration tests of the preload library, one binary: unmodified programs over it.

mod programs;
mod rsocket;
