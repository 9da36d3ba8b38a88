//! The `max_level_off` build, which BENCHMARKS-history.md's RAS overhead table compares against:
//! with the feature, every record is compiled out, whatever the run-time levels say; without
//! it, the very same code produces its records (so this file checks both builds, and CI runs
//! it in both: `cargo test -p softwarp-ras --features max_level_off --test compiled_out`).
//!
//! A test binary of its own (not a module of `it`): CI builds it alone with the feature, and
//! it sets every process-wide level to the most verbose, which the tests of `it` must not see.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use softwarp_ras::sw_event;
use softwarp_ras::trace::{
    control, FlightRecorder, FlightRecorderLayer, Level, RecorderFilter, COMPILED_IN,
};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, Registry};

static QPN_EVALUATIONS: AtomicU32 = AtomicU32::new(0);

fn qpn() -> u32 {
    QPN_EVALUATIONS.fetch_add(1, Ordering::Relaxed);
    17
}

#[test]
fn records_exist_exactly_when_tracing_is_compiled_in() {
    // Everything as verbose as it goes: any record that can exist, exists.
    control().set_all(Level::DATA);
    control().set_recorder_level(Level::DATA);
    let recorder = Arc::new(FlightRecorder::new(64));
    let subscriber = Registry::default().with(
        FlightRecorderLayer::new(Arc::clone(&recorder)).with_filter(RecorderFilter::global()),
    );
    tracing::subscriber::with_default(subscriber, || {
        sw_event!(Qp, 1, qpn = qpn(), "qp error");
        sw_event!(Engine, 9, qpn = qpn(), bytes = ?[1u8, 2, 3]);
        sw_event!(Cq, 2, "cq overflow");
        tracing::error!("a plain tracing record");
    });
    let messages: Vec<String> = recorder.snapshot().into_iter().map(|r| r.message).collect();
    if COMPILED_IN {
        assert_eq!(messages.len(), 4, "{messages:?}");
        assert_eq!(QPN_EVALUATIONS.load(Ordering::Relaxed), 2);
    } else {
        assert!(
            messages.is_empty(),
            "compiled out, yet recorded: {messages:?}"
        );
        assert_eq!(QPN_EVALUATIONS.load(Ordering::Relaxed), 0);
        // The levels themselves still work: operators can set and read them.
        assert_eq!(control().recorder_level(), Level::DATA);
    }
}
