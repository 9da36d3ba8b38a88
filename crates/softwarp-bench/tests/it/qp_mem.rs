//! `qp_mem` runs in the `softwarp-bench` program, which installs the counting allocator, and
//! only there: `softwarp bench qp_mem` (no counting allocator) refuses and names the program.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

#[test]
fn softwarp_bench_program_counts_heap_bytes_per_connected_qp() {
    let out = Command::new(env!("CARGO_BIN_EXE_softwarp-bench"))
        .args(["qp_mem", "-q", "4", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: softwarp_bench::report::Document = serde_json::from_slice(&out.stdout).unwrap();
    let m = v.qp_memory.unwrap();
    assert_eq!(m.qps, 4);
    assert!(m.heap_bytes_per_qp > 0.0, "{v:?}");
}
