//! What cargo built next to the running test binary (`target/<profile>/deps/<test>-<hash>`):
//! the shared libraries of the workspace (`libsoftwarp_verbs.so`, `libsoftwarp_preload.so`)
//! and its examples. Binaries of the test's own package are `env!("CARGO_BIN_EXE_<name>")`.

use std::path::PathBuf;

/// `target/<profile>`, the directory above the running test binary's `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("target/<profile>/deps");
    deps.parent().expect("target/<profile>").to_path_buf()
}

/// The shared library `file` (e.g. `libsoftwarp_preload.so`) as cargo built it in this
/// target directory (`deps/`, or the profile directory), if it did.
pub fn library(file: &str) -> Option<PathBuf> {
    let dir = profile_dir();
    [dir.join("deps").join(file), dir.join(file)]
        .into_iter()
        .find(|p| p.exists())
}

/// The example program `name` of this target directory, if cargo built it (`cargo test`
/// builds a package's examples; `cargo test --test X` does not).
pub fn example(name: &str) -> Option<PathBuf> {
    let p = profile_dir().join("examples").join(name);
    p.exists().then_some(p)
}
