//! The integration tests of the C ABI (`libibverbs.so.1`/`librdmacm.so.1`), one binary:
//! Debian's programs and the C tests under `c/` (`debian_tools`), Debian's rping against
//! Softwarp's Rust rping (`mixed_rping`), and Debian's `librspreload.so` over the library
//! (`rspreload`), and the device layer over a stand-in host rdma-core (`host_devices`). Their tests take turns (`softwarp_testkit::serial`): the programs spin on
//! the CPU, and the machine has two cores.

mod debian_tools;
mod host_devices;
mod mixed_rping;
mod rspreload;
