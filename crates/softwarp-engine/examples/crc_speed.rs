//! CRC32c throughput on this CPU, for the numbers BENCHMARKS.md quotes: the payload CRC the
//! engine uses for 512 bytes and more (`crc_fast`, carry-less multiplication), the short
//! CRC32-instruction loop it uses below that (`softwarp_wire::crc::crc32c_append`), and the
//! `crc32c` crate both replace. (The short loop is compiled in for inputs under 512 bytes
//! only; longer ones go to the `crc32c` crate, so its column repeats the crate's there.)
//! The last column is the CRC the engine runs over payload in a registered region
//! (`Region::crc32c_append`): from 256 bytes on, on CPUs with AVX-512F and VPCLMULQDQ,
//! carry-less-multiply folding over 64-byte `asm!` loads (never a slice over region memory:
//! the memory model of `softwarp_engine::memory`); otherwise, and for shorter ranges and the
//! ends, words loaded atomically into the CRC32 instruction, three interleaved streams from
//! 768 bytes on.
//!
//! ```text
//! cargo run --release -p softwarp-engine --example crc_speed
//! ```
//!
//! Hot cache (the same buffer again and again): an upper bound for the data path, where the
//! sender's CRC reads a source region and the receiver's the payload it just placed.

use std::hint::black_box;
use std::time::Instant;

use softwarp_engine::memory::Region;

/// Bytes hashed per measurement.
const TOTAL: usize = 2 << 30;

fn gb_per_s(size: usize, mut f: impl FnMut(&[u8]) -> u32) -> f64 {
    let buf: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    let iters = (TOTAL / size).max(1);
    let t = Instant::now();
    let mut acc = 0u32;
    for _ in 0..iters {
        acc ^= f(black_box(&buf));
    }
    black_box(acc);
    (iters * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// [`gb_per_s`] for the CRC over `size` bytes of a registered region.
fn region_gb_per_s(size: usize) -> f64 {
    let buf: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    let region = Region::new_zeroed(size).expect("allocate the region");
    region.write_at(0, &buf).expect("fill the region");
    let iters = (TOTAL / size).max(1);
    let t = Instant::now();
    let mut acc = 0u32;
    for _ in 0..iters {
        acc ^= black_box(&region)
            .crc32c_append(0, 0, size)
            .expect("in bounds");
    }
    black_box(acc);
    (iters * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn main() {
    println!(
        "{:>8}  {:>12}  {:>12}  {:>12}  {:>12}",
        "bytes", "crc_fast", "short loop", "crc32c crate", "region"
    );
    for size in [88usize, 256, 512, 1024, 4096, 32768, 65536, 1 << 20] {
        let fast = gb_per_s(size, |b| {
            crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, b) as u32
        });
        let short = gb_per_s(size, |b| softwarp_wire::crc::crc32c_append(0, b));
        let krate = gb_per_s(size, crc32c::crc32c);
        let region = region_gb_per_s(size);
        println!(
            "{size:>8}  {fast:>9.1} GB/s  {short:>9.1} GB/s  {krate:>9.1} GB/s  {region:>9.1} GB/s"
        );
    }
    println!(
        "crc_fast path: {}; short loop compiled in: {}",
        crc_fast::get_calculator_target(crc_fast::CrcAlgorithm::Crc32Iscsi),
        cfg!(all(target_arch = "x86_64", target_feature = "sse4.2"))
    );
}
