//! io_uring against plain socket calls on loopback TCP, measured on this machine.
//!
//! `cargo run --release` runs everything (about 1-2 minutes) and prints Markdown tables:
//! 8-byte ping-pong latency four ways, and streaming 1 MiB, 64 KiB and 64x64 B writes four
//! ways; every row is the median of `--runs` runs, the variants alternating inside each run.

mod common;
mod lat;
mod ring;
mod stream;

use std::io;
use std::process::ExitCode;

use io_uring::{opcode, register::Probe, IoUring};

use common::{load_average, median};

struct Args {
    runs: usize,
    iters: usize,
    warmup: usize,
    scale: f64,
    lat: bool,
    stream: bool,
}

const USAGE: &str = "usage: uring-bench [--runs N (5)] [--iters N (20000)] [--warmup N (2000)] \
                     [--scale F (1.0: 1 GiB per 1 MiB run)] [--only lat|stream]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        runs: 5,
        iters: 20_000,
        warmup: 2_000,
        scale: 1.0,
        lat: true,
        stream: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let bad = |v: &str| format!("bad value {v:?} for {flag}\n{USAGE}");
        match flag.as_str() {
            "--runs" => {
                let v = value()?;
                a.runs = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(&v))?;
            }
            "--iters" => {
                let v = value()?;
                a.iters = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(&v))?;
            }
            "--warmup" => {
                let v = value()?;
                a.warmup = v.parse().map_err(|_| bad(&v))?;
            }
            "--scale" => {
                let v = value()?;
                a.scale = v
                    .parse()
                    .ok()
                    .filter(|&f: &f64| f > 0.0 && f <= 16.0)
                    .ok_or_else(|| bad(&v))?;
            }
            "--only" => {
                let v = value()?;
                match v.as_str() {
                    "lat" => a.stream = false,
                    "stream" => a.lat = false,
                    _ => return Err(bad(&v)),
                }
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            _ => return Err(format!("unknown argument {flag:?}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("uring-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

fn send_zc_supported() -> io::Result<bool> {
    let ring = IoUring::new(8)?;
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    Ok(probe.is_supported(opcode::SendZc::CODE))
}

fn fmt_range(v: &[f64], digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.digits$}-{hi:.digits$}")
}

fn run(args: &Args) -> io::Result<()> {
    println!(
        "kernel {}, {} CPUs, {} runs per row, variants alternating inside each run",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.runs
    );
    if args.lat {
        latency(args)?;
    }
    if args.stream {
        streaming(args)?;
    }
    Ok(())
}

fn latency(args: &Args) -> io::Result<()> {
    let load0 = load_average();
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); lat::Variant::ALL.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); lat::Variant::ALL.len()];
    let mut mean: Vec<Vec<f64>> = vec![Vec::new(); lat::Variant::ALL.len()];
    let mut p99: Vec<Vec<f64>> = vec![Vec::new(); lat::Variant::ALL.len()];
    let mut fewest = vec![usize::MAX; lat::Variant::ALL.len()];
    let mut refused: Vec<Option<String>> = vec![None; lat::Variant::ALL.len()];
    for _ in 0..args.runs {
        for (k, &v) in lat::Variant::ALL.iter().enumerate() {
            if refused[k].is_some() {
                continue;
            }
            match lat::run(v, args.warmup, args.iters) {
                Ok(s) => {
                    lat[k].push(s.half_rtt_us);
                    cpu[k].push(s.cpu_us_per_rt);
                    mean[k].push(s.mean_us);
                    p99[k].push(s.p99_us);
                    fewest[k] = fewest[k].min(s.iters);
                }
                // SQPOLL may be refused (EPERM without privileges on older kernels).
                Err(e) if v == lat::Variant::UringSqpoll && lat[k].is_empty() => {
                    refused[k] = Some(e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
    }
    println!();
    println!(
        "Latency, 8 B ping-pong, half round trip, median of {} iterations (after {} warm-up; \
         a run stops timing after 4 s) per run; mean and p99 are medians of the runs'; load {} -> {}",
        args.iters,
        args.warmup,
        load0,
        load_average()
    );
    println!();
    println!(
        "| variant | half round trip (median of runs) | runs' range | mean | p99 | CPU, both ends, per round trip | fewest iterations in a run |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (k, &v) in lat::Variant::ALL.iter().enumerate() {
        if let Some(why) = &refused[k] {
            println!("| {} | refused: {why} | | | | | |", v.label());
            continue;
        }
        let r = fmt_range(&lat[k], 2);
        println!(
            "| {} | {:.2} us | {r} us | {:.2} us | {:.2} us | {:.1} us | {} |",
            v.label(),
            median(&mut lat[k]),
            median(&mut mean[k]),
            median(&mut p99[k]),
            median(&mut cpu[k]),
            fewest[k]
        );
    }
    Ok(())
}

fn streaming(args: &Args) -> io::Result<()> {
    const MIB: u64 = 1 << 20;
    let zc = send_zc_supported()?;
    // (label, bytes per write, bytes per run)
    let shapes: [(&str, usize, u64); 3] = [
        ("1 MiB writes", 1 << 20, 1024 * MIB),
        ("64 KiB writes", 64 << 10, 512 * MIB),
        ("64 x 64 B records per write", 64 * 64, 128 * MIB),
    ];
    let variants: Vec<stream::Variant> = stream::Variant::ALL
        .into_iter()
        .filter(|&v| zc || v != stream::Variant::UringSendZc)
        .collect();
    for (label, chunk, bytes) in shapes {
        let total = ((bytes as f64 * args.scale) as u64).max(chunk as u64);
        let load0 = load_average();
        let n = variants.len();
        let mut bw: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut zc_note = (0u64, 0u64);
        for _ in 0..args.runs {
            for (k, &v) in variants.iter().enumerate() {
                let s = stream::run(v, chunk, total)?;
                bw[k].push(s.gbit_s);
                cpu[k].push(s.cpu_s_per_gib);
                zc_note.0 += s.zc_copied;
                zc_note.1 += s.zc_notifs;
            }
        }
        println!();
        println!(
            "Streaming, {label}, {} MiB per run, reader: blocking read, 1 MiB buffer; load {} -> {}",
            total / MIB,
            load0,
            load_average()
        );
        println!();
        let records = chunk == 64 * 64;
        println!("| variant | throughput (median of runs) | runs' range | CPU, both ends |");
        println!("|---|---|---|---|");
        for (k, &v) in variants.iter().enumerate() {
            let r = fmt_range(&bw[k], 2);
            let m = median(&mut bw[k]);
            let rate = if records {
                format!(" ({:.2} M records/s)", m * 1e9 / 8.0 / 64.0 / 1e6)
            } else {
                String::new()
            };
            println!(
                "| {} | {m:.2} Gbit/s{rate} | {r} Gbit/s | {:.3} s/GiB |",
                v.label(),
                median(&mut cpu[k])
            );
        }
        if zc {
            println!();
            println!(
                "send_zc: {} of {} notifications said the kernel copied the data anyway",
                zc_note.0, zc_note.1
            );
        } else {
            println!("\nsend_zc: IORING_OP_SEND_ZC not supported by this kernel");
        }
    }
    Ok(())
}
