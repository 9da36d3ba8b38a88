//! The `tracing-subscriber` pieces: two per-layer filters that read the run-time levels of a
//! [`TraceControl`], the layer that feeds the flight recorder, and a console layer that
//! prints records (with cpu, thread, file, line) to stderr or any writer.
//!
//! Filters answer "never" for callsites no current level can enable, so disabled `tracing`
//! events cost what they cost without a subscriber; every level change rebuilds `tracing`'s
//! interest cache ([`TraceControl`] does it).

use std::io::Write;
use std::sync::{Arc, Mutex};

use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::filter::Filtered;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Filter, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Registry;

use super::record::event_qpn;
use super::{classify, control, flight_recorder, tracing_level, FlightRecorder, Record};
use super::{TraceControl, TraceError};

fn level_filter(n: u8) -> LevelFilter {
    if n == 0 {
        LevelFilter::OFF
    } else {
        LevelFilter::from_level(tracing_level(n))
    }
}

/// Lets through what is *traced*: records within their component's level or their QP's own
/// level. Put it on the layer that shows records to people (the console, a log file, an
/// OpenTelemetry exporter).
#[derive(Debug, Clone, Copy)]
pub struct TraceFilter {
    control: &'static TraceControl,
}

impl TraceFilter {
    /// A filter on `control`'s levels.
    pub fn new(control: &'static TraceControl) -> Self {
        Self { control }
    }

    /// A filter on the process-wide levels ([`control()`]).
    pub fn global() -> Self {
        Self::new(control())
    }
}

impl<S> Filter<S> for TraceFilter {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        let (c, l) = classify(meta);
        self.control.might_trace(c, l)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        let (c, l) = classify(meta);
        if self.control.might_trace(c, l) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn event_enabled(&self, event: &Event<'_>, _: &Context<'_, S>) -> bool {
        let (c, l) = classify(event.metadata());
        // The QP field is looked for only when the component level alone says no.
        self.control.traced(c, l, None) || self.control.traced(c, l, event_qpn(event))
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(level_filter(self.control.max_traced()))
    }
}

/// Lets through what the flight recorder keeps: traced records, and every record within the
/// recorder's own level.
#[derive(Debug, Clone, Copy)]
pub struct RecorderFilter {
    control: &'static TraceControl,
}

impl RecorderFilter {
    /// A filter on `control`'s levels.
    pub fn new(control: &'static TraceControl) -> Self {
        Self { control }
    }

    /// A filter on the process-wide levels ([`control()`]).
    pub fn global() -> Self {
        Self::new(control())
    }
}

impl<S> Filter<S> for RecorderFilter {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        let (c, l) = classify(meta);
        self.control.might_record(c, l)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        let (c, l) = classify(meta);
        if self.control.might_record(c, l) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn event_enabled(&self, event: &Event<'_>, _: &Context<'_, S>) -> bool {
        let (c, l) = classify(event.metadata());
        self.control.recorded(c, l, None) || self.control.recorded(c, l, event_qpn(event))
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(level_filter(self.control.max_recorded()))
    }
}

/// Stores every event it sees in a [`FlightRecorder`]. Use it with a [`RecorderFilter`].
#[derive(Debug, Clone)]
pub struct FlightRecorderLayer {
    recorder: Arc<FlightRecorder>,
}

impl FlightRecorderLayer {
    /// A layer feeding `recorder`.
    pub fn new(recorder: Arc<FlightRecorder>) -> Self {
        Self { recorder }
    }

    /// A layer feeding the process-wide recorder ([`flight_recorder()`]).
    pub fn global() -> Self {
        Self::new(Arc::clone(flight_recorder()))
    }
}

impl<S: Subscriber> Layer<S> for FlightRecorderLayer {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let spare = self.recorder.take_spare();
        self.recorder.push(Record::from_event(event, spare));
    }
}

/// The process-wide flight recorder as a layer for the application's own subscriber:
/// [`FlightRecorderLayer::global`] filtered by [`RecorderFilter::global`], so it keeps what
/// the trace levels and the recorder's level say, whatever the application's other layers
/// filter.
///
/// ```
/// use tracing_subscriber::layer::SubscriberExt;
/// let subscriber = tracing_subscriber::registry().with(softwarp_ras::trace::recorder_layer());
/// tracing::subscriber::with_default(subscriber, || {
///     softwarp_ras::sw_event!(Ras, 1, "kept by the flight recorder");
/// });
/// ```
pub fn recorder_layer<S>() -> Filtered<FlightRecorderLayer, RecorderFilter, S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    FlightRecorderLayer::global().with_filter(RecorderFilter::global())
}

/// Prints every event it sees as one [`Record`] line. Use it with a [`TraceFilter`].
pub struct ConsoleLayer {
    out: Mutex<Box<dyn Write + Send>>,
}

impl std::fmt::Debug for ConsoleLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleLayer").finish_non_exhaustive()
    }
}

impl ConsoleLayer {
    /// A layer writing to `out`.
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        Self {
            out: Mutex::new(out),
        }
    }

    /// A layer writing to the process's stderr.
    pub fn stderr() -> Self {
        Self::new(Box::new(std::io::stderr()))
    }
}

impl<S: Subscriber> Layer<S> for ConsoleLayer {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let line = format!("{}\n", Record::from_event(event, None));
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        // A console that cannot be written to must not take the stack down.
        let _ = out.write_all(line.as_bytes());
    }
}

/// Installs the process-wide `tracing` subscriber: the console layer (stderr) filtered by the
/// trace levels, and the process-wide flight recorder filtered by its level. Call
/// [`init_from_env`](super::init_from_env) first to apply `SOFTWARP_TRACE`.
///
/// Nothing calls it implicitly: the `softwarp` CLI does, and a service started with
/// [`ServiceConfig::install_tracing`](crate::service::ServiceConfig::install_tracing).
/// Fails with [`TraceError::AlreadyInstalled`] when the application installed its own
/// subscriber; it can add [`recorder_layer`] (and its own layer
/// `.with_filter(TraceFilter::global())`, if it wants Softwarp's levels there) to it instead.
pub fn install_global() -> Result<(), TraceError> {
    let subscriber = Registry::default()
        .with(ConsoleLayer::stderr().with_filter(TraceFilter::global()))
        .with(FlightRecorderLayer::global().with_filter(RecorderFilter::global()));
    tracing::subscriber::set_global_default(subscriber).map_err(|_| TraceError::AlreadyInstalled)
}
