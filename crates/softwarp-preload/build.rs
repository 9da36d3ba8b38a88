//! Links the preload library with only its own entry points exported: the static libraries
//! it is made of (`softwarp-verbs`' among them, whose rlib carries rdma-core's symbols at
//! their versions, `ibv_*`, `rdma_*`, `rsocket`) stay hidden, so a preloaded program's own
//! libibverbs or librdmacm is never interposed by them.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
}
