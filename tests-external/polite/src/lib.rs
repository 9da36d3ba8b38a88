//! What both programs share: the application's own subscriber (a `fmt` layer writing into
//! memory, filtered RUST_LOG-style by `tracing_subscriber`'s `Targets`), the device work
//! that makes Softwarp emit records, and the checks.
//!
//! Each program takes `--ras` to ask for the RAS services (then files and a thread must
//! appear, and the flight recorder must fill); without it nothing may appear. The runtime
//! directory is the one `SOFTWARP_RUNTIME_DIR` names (a fresh, empty directory of the
//! driving test).

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use softwarp::{Device, QpInitAttr, RasConfig};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The application's filter, as a program would take it from `RUST_LOG`: its own records,
/// Softwarp's at `info`, but the QP component only from `warn` (so "QP created", a level 4
/// = `INFO` record of target `softwarp::qp`, must not show).
pub const FILTER: &str = "polite=info,softwarp=info,softwarp::qp=warn";

/// Everything the application's `fmt` layer wrote.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// The text written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// One write of the `fmt` layer.
pub struct CapturedWriter(Arc<Mutex<Vec<u8>>>);

impl Write for CapturedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = CapturedWriter;
    fn make_writer(&'a self) -> Self::Writer {
        CapturedWriter(Arc::clone(&self.0))
    }
}

/// Whether the program was asked to enable RAS (`--ras`).
pub fn ras_requested() -> bool {
    std::env::args().skip(1).any(|a| a == "--ras")
}

/// The runtime directory the driving test gave (`SOFTWARP_RUNTIME_DIR`).
pub fn runtime_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("SOFTWARP_RUNTIME_DIR").expect("SOFTWARP_RUNTIME_DIR unset"))
}

/// Names of the files in the runtime directory.
pub fn runtime_files() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(runtime_dir())
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Installs the application's own global subscriber (with `tracing_subscriber`'s `init`,
/// which panics if a global subscriber is installed already), plus Softwarp's flight
/// recorder layer when RAS is on.
pub fn install_own_subscriber(out: &Captured, ras: bool) {
    let filter: Targets = FILTER.parse().expect("filter");
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(out.clone())
                .with_ansi(false)
                .with_filter(filter),
        )
        .with(ras.then(softwarp::flight_recorder_layer))
        .init();
}

/// Opens a device, asking for RAS when `ras`.
pub fn open(ras: bool) -> Device {
    if ras {
        Device::builder()
            .ras(RasConfig::from_env())
            .open()
            .expect("open with RAS")
    } else {
        Device::open_default().expect("open")
    }
}

/// Creates and drops a PD, a CQ and a QP on `dev` (records of levels 4 of the `mr`, `cq`
/// and `qp` components).
pub fn use_device(dev: &Device) {
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(16, None).expect("cq");
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).expect("qp");
    drop(qp);
    drop(cq);
    drop(pd);
}

/// The checks after the device work; `devices`: devices open now (one progress thread
/// each).
pub fn check(out: &Captured, ras: bool, devices: usize) {
    let text = out.text();
    assert!(
        text.contains("application record"),
        "the application's own record is missing:\n{text}"
    );
    assert!(
        text.contains("softwarp::runtime") && text.contains("device opened"),
        "Softwarp's records did not reach the application's subscriber:\n{text}"
    );
    assert!(
        !text.contains("QP created"),
        "the application's filter (softwarp::qp=warn) was not applied:\n{text}"
    );
    let files = runtime_files();
    let threads = threads();
    if ras {
        assert!(
            files.iter().any(|f| f.ends_with(".sock"))
                && files.iter().any(|f| f.ends_with(".json")),
            "RAS enabled but no control socket and registry entry: {files:?}"
        );
        assert!(
            threads > 1 + devices,
            "RAS enabled but no control socket thread ({threads} threads)"
        );
        let recorded = softwarp_ras::trace::flight_recorder()
            .snapshot()
            .into_iter()
            .any(|r| r.message.contains("device opened"));
        assert!(recorded, "the flight recorder layer kept no record");
    } else {
        assert!(files.is_empty(), "files written without RAS: {files:?}");
        assert_eq!(
            threads,
            1 + devices,
            "threads besides main and the progress thread(s)"
        );
    }
    println!(
        "ras={ras} threads={threads} files={files:?} records={}",
        text.lines().count()
    );
}

/// The fast CRC is chosen at run time in this build, which has default flags.
pub fn check_crc() {
    #[cfg(target_arch = "x86_64")]
    {
        assert!(
            // A constant of this build, read at run time so that it is checked, not folded.
            !std::hint::black_box(cfg!(target_feature = "sse4.2")),
            "this check must be built with default flags (RUSTFLAGS leaked into the build)"
        );
        let expected = if std::arch::is_x86_feature_detected!("sse4.2") {
            softwarp_wire::crc::Backend::Sse42
        } else {
            softwarp_wire::crc::Backend::Crate
        };
        assert_eq!(softwarp_wire::crc::backend(), expected);
    }
    assert_eq!(softwarp_wire::crc::crc32c(b"123456789"), 0xe306_9283);
    // The short path chosen at run time agrees with the long one (the `crc32c` crate, for
    // inputs of SHORT_INPUT bytes and more) over every piece size and alignment.
    let data: Vec<u8> = (0..1100u32).map(|i| (i * 131 + 7) as u8).collect();
    let whole = softwarp_wire::crc::crc32c(&data);
    for piece in 1..softwarp_wire::crc::SHORT_INPUT {
        let pieces = data
            .chunks(piece)
            .fold(0, softwarp_wire::crc::crc32c_append);
        assert_eq!(pieces, whole, "pieces of {piece} bytes");
    }
    println!("crc backend: {}", softwarp_wire::crc::backend());
}
