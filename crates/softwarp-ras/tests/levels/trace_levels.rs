//! Run-time trace levels seen through real `tracing` dispatch: records appear and disappear
//! in a flight recorder (and a console) as levels change, per component and per QP, without
//! rebuilding anything.
//!
//! The levels are process-wide, so the tests of this binary take turns (one lock:
//! `softwarp_testkit::serial`).
//! (Built with `--features max_level_off` there are no records at all: `compiled_out.rs`.)

#![cfg(not(feature = "max_level_off"))]
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard};

use softwarp_ras::sw_event;
use softwarp_ras::trace::{
    control, Component, ConsoleLayer, FlightRecorder, FlightRecorderLayer, Level, RecorderFilter,
    TraceFilter,
};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, Registry};

/// Takes the turn and resets every level: components and other at 1, recorder off, no QP.
fn turn() -> MutexGuard<'static, ()> {
    let g = softwarp_testkit::serial();

    control().set_all(Level::ERROR);
    control().set_recorder_level(Level::OFF);
    control().clear_qp_levels();
    g
}

#[derive(Clone, Default)]
struct Console(Arc<Mutex<Vec<u8>>>);

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Console {
    fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// Runs `f` with a subscriber made of a fresh recorder (capacity 64) and a console, both on
/// the process-wide levels.
fn with_sinks(f: impl FnOnce()) -> (Vec<softwarp_ras::trace::Record>, Vec<String>) {
    let recorder = Arc::new(FlightRecorder::new(64));
    let console = Console::default();
    let subscriber = Registry::default()
        .with(ConsoleLayer::new(Box::new(console.clone())).with_filter(TraceFilter::global()))
        .with(
            FlightRecorderLayer::new(Arc::clone(&recorder)).with_filter(RecorderFilter::global()),
        );
    tracing::subscriber::with_default(subscriber, f);
    (recorder.snapshot(), console.lines())
}

fn messages(records: &[softwarp_ras::trace::Record]) -> Vec<String> {
    records.iter().map(|r| r.message.clone()).collect()
}

/// One call site for every emission, so the test also proves that `tracing`'s per-callsite
/// interest cache follows level changes.
fn qp_internals(qpn: u32, msg: &str) {
    sw_event!(Qp, 5, qpn = qpn, "{}", msg);
}

#[test]
fn a_record_without_a_qp_names_its_function_too_and_fields_stay_clean() {
    let _t = turn();
    let (records, _) = with_sinks(|| {
        control().set_level(Component::Cq, Level::RARE);
        cq_overflow();
    });
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].function, "levels::trace_levels::cq_overflow");
    assert_eq!(records[0].fields, "depth=4");
    assert_eq!(records[0].message, "overflow");
}

fn cq_overflow() {
    sw_event!(Cq, 2, depth = 4, "overflow");
}

#[test]
fn raising_and_lowering_a_component_level_makes_records_appear_and_disappear() {
    let _t = turn();
    let (records, console) = with_sinks(|| {
        qp_internals(1, "before");
        control().set_level(Component::Qp, Level::INTERNALS);
        qp_internals(1, "raised");
        control().set_level(Component::Cq, Level::OFF);
        qp_internals(1, "still raised");
        control().set_level(Component::Qp, Level::ERROR);
        qp_internals(1, "lowered");
    });
    assert_eq!(messages(&records), ["raised", "still raised"]);
    assert_eq!(console.len(), 2);
    assert!(console[0].contains(" L5 qp "), "{}", console[0]);
    assert!(console[0].contains("qpn=1"), "{}", console[0]);
    assert!(console[0].ends_with(": raised"), "{}", console[0]);
}

#[test]
fn a_qp_level_shows_only_that_qps_records() {
    let _t = turn();
    let (records, _) = with_sinks(|| {
        control().set_qp_level(17, Level::INTERNALS).unwrap();
        qp_internals(17, "seventeen");
        qp_internals(18, "eighteen");
        sw_event!(Engine, 5, qpn = 17, "engine of seventeen");
        sw_event!(Engine, 5, "engine without qp");
        control().set_qp_level(17, Level::OFF).unwrap();
        qp_internals(17, "seventeen after");
    });
    assert_eq!(messages(&records), ["seventeen", "engine of seventeen"]);
    assert_eq!(records[0].qpn, Some(17));
    assert_eq!(records[1].component, Some(Component::Engine));
}

#[test]
fn the_recorder_level_records_what_the_console_does_not_show() {
    let _t = turn();
    let (records, console) = with_sinks(|| {
        control().set_recorder_level(Level::INTERNALS);
        qp_internals(2, "internal");
        sw_event!(Cq, 1, "an error");
        sw_event!(Cq, 6, "too verbose for both");
    });
    assert_eq!(messages(&records), ["internal", "an error"]);
    assert_eq!(console.len(), 1);
    assert!(console[0].ends_with(": an error"));
}

#[test]
fn records_carry_cpu_thread_file_line_module_function_and_qp() {
    let _t = turn();
    let mut line = 0;
    let (records, _) = with_sinks(|| {
        control().set_level(Component::Mr, Level::ENTRY_EXIT);
        line = line!() + 1;
        sw_event!(
            Mr,
            4,
            qpn = 0x2a,
            stag = 0x1234u32,
            len = 4096usize,
            "reg_mr {}",
            "done"
        );
    });
    let r = &records[0];
    assert_eq!(r.level, 4);
    assert_eq!(r.component, Some(Component::Mr));
    assert_eq!(r.target, "softwarp::mr");
    assert_eq!(r.qpn, Some(42));
    assert_eq!(r.file.as_deref(), Some(file!()));
    assert_eq!(r.line, Some(line));
    assert_eq!(r.module.as_deref(), Some(module_path!()));
    // The emitting function; inside the closure given to with_sinks.
    assert_eq!(
        r.function,
        "levels::trace_levels::records_carry_cpu_thread_file_line_module_function_and_qp::{{closure}}"
    );
    assert!(r.to_string().contains(&format!(
        "trace_levels.rs:{line} levels::trace_levels::records_carry_cpu_thread_file_line_module_function_and_qp::{{{{closure}}}}: reg_mr done"
    )));
    assert!(r.cpu.is_some());
    assert_ne!(r.tid, 0);
    assert!(r.time_unix_ns > 0);
    assert_eq!(r.message, "reg_mr done");
    assert_eq!(r.fields, "stag=4660 len=4096");
    assert_eq!(r.seq, 1);
}

#[test]
fn plain_tracing_events_are_attributed_and_filtered_too() {
    let _t = turn();
    let (records, _) = with_sinks(|| {
        // The runtime crate's module path for its qp module, at DEBUG = level 5.
        tracing::debug!(target: "softwarp::qp", qpn = 5u32, "plain debug");
        control().set_level(Component::Qp, Level::INTERNALS);
        tracing::debug!(target: "softwarp::qp", qpn = 5u32, "plain debug again");
        tracing::trace!(target: "softwarp::qp", "plain trace is level 8");
        // Another crate's event follows `other`.
        tracing::warn!(target: "somecrate", "foreign warn");
        control().set_other_level(Level::RARE);
        tracing::warn!(target: "somecrate", "foreign warn shown");
    });
    assert_eq!(
        messages(&records),
        ["plain debug again", "foreign warn shown"]
    );
    assert_eq!(records[0].level, 5);
    assert_eq!(records[0].qpn, Some(5));
    assert_eq!(records[1].component, None);
    assert_eq!(records[1].level, 2);
}

#[test]
fn a_closed_gate_does_not_evaluate_the_qp_expression() {
    let _t = turn();
    let evaluated = std::cell::Cell::new(0);
    let qpn = || {
        evaluated.set(evaluated.get() + 1);
        9u32
    };
    sw_event!(Qp, 8, qpn = qpn(), "hot internals");
    assert_eq!(evaluated.get(), 0);
    control().set_level(Component::Qp, Level::HOT_INTERNALS);
    sw_event!(Qp, 8, qpn = qpn(), "hot internals");
    assert_eq!(evaluated.get(), 1);
}

#[test]
fn the_env_spec_syntax_drives_the_same_levels() {
    let _t = turn();
    let (records, _) = with_sinks(|| {
        control().apply_str("default=1,qp=5,recorder=0").unwrap();
        qp_internals(3, "by spec");
        control().apply_str("qp=off").unwrap();
        qp_internals(3, "off by spec");
    });
    assert_eq!(messages(&records), ["by spec"]);
}

/// Counts every event `tracing` dispatches to it (no filter of its own).
struct Counting(Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for Counting {
    fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn records_of_other_qps_never_reach_tracing_while_one_qp_is_verbose() {
    let _t = turn();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let subscriber = Registry::default().with(Counting(Arc::clone(&seen)));
    tracing::subscriber::with_default(subscriber, || {
        control().set_qp_level(17, Level::DATA).unwrap();
        for qpn in 0..100 {
            if qpn != 17 {
                sw_event!(Engine, 9, qpn = qpn, "payload");
            }
        }
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 0);
        sw_event!(Engine, 9, qpn = 17, "payload");
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 1);
    });
    control().clear_qp_levels();
}

/// Runs in a child process started by `initial_levels_come_from_the_environment` (the
/// environment of a running test process cannot be changed safely); passes trivially when
/// run on its own.
#[test]
#[ignore = "run in a child process by initial_levels_come_from_the_environment"]
fn child_applies_the_environment() {
    if std::env::var("SOFTWARP_TRACE").is_err() {
        return;
    }
    softwarp_ras::trace::init_from_env().unwrap();
    let c = control();
    assert_eq!(c.level(Component::Qp), Level::new(7).unwrap());
    assert_eq!(c.level(Component::Cq), Level::RARE);
    assert_eq!(c.level(Component::Wire), Level::new(3).unwrap());
    assert_eq!(c.recorder_level(), Level::HOT_INTERNALS);
    assert_eq!(c.qp_level(9), Some(Level::HOT_INTERNALS));
    assert_eq!(softwarp_ras::trace::flight_recorder().capacity(), 16);
}

#[test]
fn initial_levels_come_from_the_environment() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "trace_levels::child_applies_the_environment",
            "--ignored",
            "--test-threads=1",
        ])
        .env("SOFTWARP_TRACE", "qp=7, cq=2,default=3,qpn:9=8,recorder=8")
        .env("SOFTWARP_FLIGHT_RECORDER", "16")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}
