//! One trace record as the flight recorder keeps it and the console prints it: when, where
//! (cpu, thread, file, line, module, function), what (component, level, QP, message, fields). Built
//! from a `tracing` event; no I/O here.

use std::borrow::Cow;
use std::fmt::{self, Write as _};

use serde::{Deserialize, Serialize};
use tracing::field::{Field, Visit};

use super::{classify, Component};
use crate::{clock, sys};

/// Most bytes kept of a record's message, and of its other fields (longer text is cut at a
/// character boundary and ends with `…`), so a level 9 data dump cannot blow up the ring.
pub const MAX_RECORD_TEXT: usize = 4096;

/// A trace record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Sequence number in its flight recorder (0 until stored); increases by one per record,
    /// so gaps show evicted records.
    pub seq: u64,
    /// Wall-clock time, nanoseconds since the Unix epoch.
    pub time_unix_ns: u64,
    /// Softwarp level 1-9.
    pub level: u8,
    /// The component, `None` for another crate's event.
    pub component: Option<Component>,
    /// The `tracing` target.
    pub target: Cow<'static, str>,
    /// The QP the record is about (the event's `qpn` field).
    pub qpn: Option<u32>,
    /// The CPU the emitting thread ran on.
    pub cpu: Option<u32>,
    /// The kernel thread id of the emitting thread.
    pub tid: u32,
    /// Source file of the call site.
    pub file: Option<Cow<'static, str>>,
    /// Source line of the call site.
    pub line: Option<u32>,
    /// Module path of the call site.
    pub module: Option<Cow<'static, str>>,
    /// The function of the call site, as a path (`softwarp::qp::QpShared::drain`; closures
    /// add `{{closure}}`), for records made by [`sw_event!`](crate::sw_event); empty for
    /// other crates' events, which `tracing` gives no function for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub function: String,
    /// The formatted message.
    pub message: String,
    /// The other fields, `name=value` separated by spaces (`Debug` formatting of values).
    pub fields: String,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            seq: 0,
            time_unix_ns: 0,
            level: 0,
            component: None,
            target: Cow::Borrowed(""),
            qpn: None,
            cpu: None,
            tid: 0,
            file: None,
            line: None,
            module: None,
            function: String::new(),
            message: String::new(),
            fields: String::new(),
        }
    }
}

impl Record {
    /// A record of `event`, reusing the text buffers of `spare` (an evicted record) when
    /// given, so a full flight recorder does not allocate per record.
    pub fn from_event(event: &tracing::Event<'_>, spare: Option<Record>) -> Record {
        let meta = event.metadata();
        let (component, level) = classify(meta);
        let mut rec = spare.unwrap_or_default();
        rec.message.clear();
        rec.fields.clear();
        rec.function.clear();
        rec.seq = 0;
        rec.time_unix_ns = clock::now_unix_ns();
        rec.level = level;
        rec.component = component;
        rec.target = Cow::Borrowed(meta.target());
        rec.cpu = sys::current_cpu();
        rec.tid = sys::tid();
        rec.file = meta.file().map(Cow::Borrowed);
        rec.line = meta.line();
        rec.module = meta.module_path().map(Cow::Borrowed);
        let mut v = RecordVisitor {
            message: Bounded::new(&mut rec.message),
            fields: Bounded::new(&mut rec.fields),
            function: Bounded::new(&mut rec.function),
            qpn: None,
        };
        event.record(&mut v);
        v.message.finish();
        v.fields.finish();
        rec.qpn = v.qpn;
        rec
    }

    /// The record's time as RFC 3339 UTC text.
    pub fn time(&self) -> String {
        clock::rfc3339_from_unix_ns(self.time_unix_ns)
    }
}

impl fmt::Display for Record {
    /// One line: `time L<level> <component> cpu<n> tid<n> [qpn=<n>] file:line function: message
    /// fields` (the module path where the function is not known).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} L{} ", self.time(), self.level)?;
        match self.component {
            Some(c) => write!(f, "{c}")?,
            None => write!(f, "{}", self.target)?,
        }
        match self.cpu {
            Some(c) => write!(f, " cpu{c}")?,
            None => f.write_str(" cpu?")?,
        }
        write!(f, " tid{}", self.tid)?;
        if let Some(q) = self.qpn {
            write!(f, " qpn={q}")?;
        }
        if let Some(file) = &self.file {
            write!(f, " {file}:{}", self.line.unwrap_or(0))?;
        }
        if !self.function.is_empty() {
            write!(f, " {}", self.function)?;
        } else if let Some(m) = &self.module {
            write!(f, " {m}")?;
        }
        f.write_str(":")?;
        if !self.message.is_empty() {
            write!(f, " {}", self.message)?;
        }
        if !self.fields.is_empty() {
            write!(f, " {}", self.fields)?;
        }
        Ok(())
    }
}

/// The field in which [`sw_event!`](crate::sw_event) passes its call site's function.
pub(crate) const FUNCTION_FIELD: &str = "swfn";

/// A `fmt::Write` into a `String` that stops at [`MAX_RECORD_TEXT`] bytes.
struct Bounded<'a> {
    s: &'a mut String,
    full: bool,
}

impl<'a> Bounded<'a> {
    fn new(s: &'a mut String) -> Self {
        Self { s, full: false }
    }

    fn finish(&mut self) {
        if self.full {
            self.s.push('…');
        }
    }
}

impl fmt::Write for Bounded<'_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        if self.full {
            return Err(fmt::Error);
        }
        let room = MAX_RECORD_TEXT.saturating_sub(self.s.len());
        if text.len() <= room {
            self.s.push_str(text);
            return Ok(());
        }
        let mut cut = room;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        self.s.push_str(text.get(..cut).unwrap_or(""));
        self.full = true;
        // Stop the formatter early: the rest would be thrown away.
        Err(fmt::Error)
    }
}

struct RecordVisitor<'a> {
    message: Bounded<'a>,
    fields: Bounded<'a>,
    function: Bounded<'a>,
    qpn: Option<u32>,
}

impl RecordVisitor<'_> {
    fn sep(&mut self) {
        if !self.fields.s.is_empty() {
            let _ = self.fields.write_str(" ");
        }
    }
}

impl Visit for RecordVisitor<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "qpn" {
            if let Ok(q) = u32::try_from(value) {
                self.qpn = Some(q);
                return;
            }
        }
        self.record_debug(field, &value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "qpn" {
            if let Ok(q) = u32::try_from(value) {
                self.qpn = Some(q);
                return;
            }
        }
        self.record_debug(field, &value);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == FUNCTION_FIELD {
            let _ = self.function.write_str(value);
            return;
        }
        self.record_debug(field, &value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
            return;
        }
        self.sep();
        let _ = write!(self.fields, "{}={value:?}", field.name());
    }
}

/// Finds the `qpn` field of an event (for per-QP filtering).
pub(crate) fn event_qpn(event: &tracing::Event<'_>) -> Option<u32> {
    struct Qpn(Option<u32>);
    impl Visit for Qpn {
        fn record_u64(&mut self, field: &Field, value: u64) {
            if field.name() == "qpn" {
                self.0 = u32::try_from(value).ok();
            }
        }
        fn record_i64(&mut self, field: &Field, value: i64) {
            if field.name() == "qpn" {
                self.0 = u32::try_from(value).ok();
            }
        }
        fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
    }
    let mut v = Qpn(None);
    event.record(&mut v);
    v.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_writer_cuts_at_a_char_boundary_and_marks_the_cut() {
        let mut s = String::new();
        let mut b = Bounded::new(&mut s);
        let long = "é".repeat(MAX_RECORD_TEXT); // 2 bytes each
        assert!(b.write_str(&long).is_err());
        assert!(b.write_str("more").is_err());
        b.finish();
        assert!(s.len() <= MAX_RECORD_TEXT + '…'.len_utf8());
        assert!(s.ends_with('…'));
    }

    #[test]
    fn display_shows_every_column() {
        let r = Record {
            seq: 3,
            time_unix_ns: 0,
            level: 5,
            component: Some(Component::Qp),
            target: Cow::Borrowed("softwarp::qp"),
            qpn: Some(17),
            cpu: Some(1),
            tid: 99,
            file: Some(Cow::Borrowed("src/qp.rs")),
            line: Some(120),
            module: Some(Cow::Borrowed("softwarp::qp")),
            function: String::new(),
            message: "posted".into(),
            fields: "len=4096".into(),
        };
        assert_eq!(
            r.to_string(),
            "1970-01-01T00:00:00.000Z L5 qp cpu1 tid99 qpn=17 src/qp.rs:120 softwarp::qp: posted len=4096"
        );
        let with_fn = Record {
            function: "softwarp::qp::QpShared::drain".into(),
            ..r
        };
        assert_eq!(
            with_fn.to_string(),
            "1970-01-01T00:00:00.000Z L5 qp cpu1 tid99 qpn=17 src/qp.rs:120 softwarp::qp::QpShared::drain: posted len=4096"
        );
    }
}
