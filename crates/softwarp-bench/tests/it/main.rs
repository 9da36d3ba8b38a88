//! The integration tests of softwarp-bench, one binary.

mod qp_mem;
