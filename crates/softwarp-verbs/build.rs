//! Links the cdylib as rdma-core's libibverbs.so.1: its soname and the version nodes of
//! `exports.map` (the symbols are bound to them by `.symver` in `src/exports.rs`).
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    println!("cargo:rerun-if-changed=exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
}
