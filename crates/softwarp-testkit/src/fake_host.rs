//! The stand-in host rdma-core of the device layer's tests (`softwarp-verbs/src/host`):
//! `softwarp-verbs/tests/c/host/fake_ibverbs.c` built with `cc` into a `libibverbs.so.1`
//! with rdma-core v44's version nodes, one device `fake0`, every call it receives appended
//! to the file `FAKE_IBV_LOG` names.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds the stand-in `libibverbs.so.1` into `dir` with the private version node `private`
/// (rdma-core v44's is `IBVERBS_PRIVATE_34`) and returns its path. Needs `cc` and rdma-core's
/// headers (the caller checks: [`crate::tool`], [`crate::file`]); panics when they fail.
pub fn fake_host_ibverbs(dir: &Path, private: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/c/host");
    let map = std::fs::read_to_string(src.join("fake_ibverbs.map")).expect("read the map");
    let map_file = dir.join("fake_ibverbs.map");
    std::fs::write(&map_file, map.replace("PRIVATE_NODE", private)).expect("write the map");
    let lib = dir.join("libibverbs.so.1");
    let built = Command::new("cc")
        .args([
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
        ])
        .arg("-Wl,-soname,libibverbs.so.1")
        .arg(format!("-Wl,--version-script={}", map_file.display()))
        .arg("-o")
        .arg(&lib)
        .arg(src.join("fake_ibverbs.c"))
        .output()
        .expect("run cc");
    assert!(
        built.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    lib
}
