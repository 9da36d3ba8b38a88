//! The component dump: the whole RAS state of a process (who it is, trace levels, every
//! device's resources, statistics, QP snapshots, the full flight recorder) in one
//! self-describing file, written on demand (`softwarp dump`, the `dump` control request) or
//! automatically when a device fails; and its parser (`softwarp decode`).
//!
//! # Format (version 1)
//!
//! Text, so `less` shows it; eye-catchers on lines of their own, so a dump is recognised
//! inside a core file or a collector's stream, and a cut or damaged one is detected:
//!
//! ```text
//! SOFTWARP-DUMP 1
//! === SOFTWARP-DUMP SECTION process 312 fnv1a64:9c2d0e4f1b7a3e55 ===
//! {"pid":4242,...}            <- exactly 312 bytes of JSON, then a newline
//! === SOFTWARP-DUMP SECTION levels 118 fnv1a64:... ===
//! ...
//! === SOFTWARP-DUMP END 7 ===
//! ```
//!
//! Sections in order: `process` ([`DumpProcess`]), `levels` ([`TraceLevels`]),
//! `resources` ([`ResourcesResult`]), `stats` ([`StatsSnapshot`]), `snapshots`
//! ([`SnapshotsResult`]), `flight-recorder` ([`FlightRecorderDump`]), `markers`
//! ([`MarkersResult`]: structure markers found damaged). Each body's length
//! and an FNV-1a 64 hash of its name and body are in its marker, and the end marker counts the sections: a
//! truncated dump lacks the end marker (or bytes of a body), a damaged one fails a hash.
//! Readers keep sections they do not know (as JSON), so later versions may add some.
//!
//! Parsing is input from outside: every failure is a typed [`DumpError`], no input panics,
//! and every length is checked against what is there.

use std::fmt;
use std::io::{self, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{ControlHandler, ResourcesResult};
use crate::markers::MarkersResult;
use crate::snapshot::{SnapshotFilter, SnapshotsResult};
use crate::stats::StatsSnapshot;
use crate::trace::{FlightRecorderDump, TraceLevels};
use crate::{clock, sys};

/// The first bytes of every dump.
pub const MAGIC: &str = "SOFTWARP-DUMP";
/// The format version written.
pub const VERSION: u32 = 1;
/// Longest marker line a reader accepts, in bytes.
pub const MAX_MARKER_LINE: usize = 256;
/// Most sections a reader accepts.
pub const MAX_SECTIONS: usize = 1024;
/// Longest section name.
pub const MAX_SECTION_NAME: usize = 64;
/// Environment variable: automatic dumps kept in the runtime directory (default
/// [`DEFAULT_AUTO_DUMPS`]; `0` or `off`: no automatic dump).
pub const AUTO_DUMPS_ENV: &str = "SOFTWARP_AUTO_DUMPS";
/// Environment variable: also send automatic dumps to this TCP collector (`host:port`).
pub const DUMP_COLLECTOR_ENV: &str = "SOFTWARP_DUMP_COLLECTOR";
/// Automatic dumps kept unless configured otherwise.
pub const DEFAULT_AUTO_DUMPS: usize = 8;
/// At most one automatic dump per this interval (a failing device must not fill the disk
/// or stall its threads writing dumps).
pub const AUTO_DUMP_INTERVAL: Duration = Duration::from_secs(1);
/// File name prefix and suffix of automatic dumps.
pub const AUTO_DUMP_PREFIX: &str = "dump-";
/// File name suffix of dumps.
pub const DUMP_SUFFIX: &str = ".swdump";

const SECTION: &str = "=== SOFTWARP-DUMP SECTION ";
const END: &str = "=== SOFTWARP-DUMP END ";
const TAIL: &str = " ===";

/// The `process` section: who wrote the dump, when and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpProcess {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub name: String,
    /// Softwarp version.
    pub version: String,
    /// When the dump was written, RFC 3339 UTC.
    pub time: String,
    /// The same, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// Why (`on demand`, `device fatal: softwarp0/2 ...`).
    pub reason: String,
}

/// FNV-1a, 64 bits (the section checksum: detects damage, not an attacker).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_more(0xcbf2_9ce4_8422_2325, bytes)
}

fn fnv1a64_more(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The checksum of a section: FNV-1a 64 over its name, a NUL and its body (a damaged name
/// is noticed too).
pub fn section_hash(name: &str, body: &[u8]) -> u64 {
    fnv1a64_more(fnv1a64_more(fnv1a64(name.as_bytes()), &[0]), body)
}

/// A number in a marker: decimal digits only (no sign, so a damaged byte cannot hide).
fn digits(s: &str) -> Option<usize> {
    if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Builds a dump section by section.
#[derive(Debug)]
pub struct DumpWriter {
    out: Vec<u8>,
    sections: usize,
}

impl Default for DumpWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl DumpWriter {
    /// A dump with its header line.
    pub fn new() -> Self {
        let mut out = Vec::with_capacity(64 * 1024);
        out.extend_from_slice(format!("{MAGIC} {VERSION}\n").as_bytes());
        Self { out, sections: 0 }
    }

    /// Appends section `name` (letters, digits, `-`, `_`; at most [`MAX_SECTION_NAME`]) with
    /// `body` as JSON.
    pub fn section<T: Serialize + ?Sized>(&mut self, name: &str, body: &T) -> io::Result<()> {
        if !valid_name(name) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad dump section name {name:?}"),
            ));
        }
        let json = serde_json::to_vec(body).map_err(io::Error::other)?;
        self.out.extend_from_slice(
            format!(
                "{SECTION}{name} {} fnv1a64:{:016x}{TAIL}\n",
                json.len(),
                section_hash(name, &json)
            )
            .as_bytes(),
        );
        self.out.extend_from_slice(&json);
        self.out.push(b'\n');
        self.sections += 1;
        Ok(())
    }

    /// The dump with its end marker.
    pub fn finish(mut self) -> Vec<u8> {
        self.out
            .extend_from_slice(format!("{END}{}{TAIL}\n", self.sections).as_bytes());
        self.out
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_SECTION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The whole state of this process as `handler` reports it, as a dump. `reason` says why
/// it was taken.
pub fn collect(handler: &dyn ControlHandler, reason: &str) -> io::Result<Vec<u8>> {
    let now = std::time::SystemTime::now();
    let mut w = DumpWriter::new();
    w.section(
        "process",
        &DumpProcess {
            pid: sys::pid(),
            name: sys::process_name().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            time: clock::rfc3339(now),
            time_unix_ms: clock::unix_ms(now),
            reason: reason.to_string(),
        },
    )?;
    w.section("levels", &handler.trace_get())?;
    w.section(
        "resources",
        &handler.resources(&crate::tracker::ResourceFilter::default()),
    )?;
    // The device-level series and, on a device of few QPs, each QP's (Detail::Auto): the
    // per-QP series of a device with 100,000 QPs would not fit a reply.
    w.section("stats", &handler.stats(&crate::stats::Detail::Auto))?;
    w.section("snapshots", &handler.snapshots(&SnapshotFilter::default()))?;
    w.section("flight-recorder", &handler.flight_recorder(None, None))?;
    w.section("markers", &crate::markers::history())?;
    Ok(w.finish())
}

/// Why bytes are not a (whole, sound) dump.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DumpError {
    /// The first line is not `SOFTWARP-DUMP <version>`.
    #[error("not a Softwarp dump (no `{MAGIC} <version>` header line)")]
    NotADump,
    /// A version this reader does not know.
    #[error("dump format version {0} is not supported (this reader knows {VERSION})")]
    UnsupportedVersion(u32),
    /// The data ends before the dump does (no end marker, or a cut section).
    #[error("the dump is truncated at byte {offset}: {what}")]
    Truncated {
        /// Where the data ends or the cut section starts.
        offset: usize,
        /// What is missing.
        what: String,
    },
    /// A line where a marker should be is not one.
    #[error("bad marker at byte {offset}: {line:?}")]
    BadMarker {
        /// Where the line starts.
        offset: usize,
        /// The line (cut to 80 characters).
        line: String,
    },
    /// A section's bytes do not hash to its marker's checksum.
    #[error("section {section:?} at byte {offset} is damaged (checksum mismatch)")]
    Checksum {
        /// The section.
        section: String,
        /// Where its marker starts.
        offset: usize,
    },
    /// A section's body is not the JSON its name promises.
    #[error("section {section:?} at byte {offset} does not decode: {error}")]
    BadSection {
        /// The section.
        section: String,
        /// Where its marker starts.
        offset: usize,
        /// What the JSON decoder said.
        error: String,
    },
    /// The end marker counts a different number of sections than were read.
    #[error("the end marker counts {expected} sections, {found} were read")]
    SectionCount {
        /// What the end marker says.
        expected: usize,
        /// What was read.
        found: usize,
    },
    /// More sections than [`MAX_SECTIONS`].
    #[error("more than {MAX_SECTIONS} sections")]
    TooManySections,
    /// Bytes after the end marker.
    #[error("{0} bytes follow the end marker")]
    TrailingData(usize),
}

/// One decoded section.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Section {
    /// `process`.
    Process(DumpProcess),
    /// `levels`.
    Levels(TraceLevels),
    /// `resources`.
    Resources(ResourcesResult),
    /// `stats`.
    Stats(StatsSnapshot),
    /// `snapshots`.
    Snapshots(SnapshotsResult),
    /// `flight-recorder`.
    FlightRecorder(FlightRecorderDump),
    /// `markers`: structure markers found damaged in this process.
    Markers(MarkersResult),
    /// A section this reader does not know, as JSON.
    Other {
        /// Its name.
        name: String,
        /// Its body.
        body: serde_json::Value,
    },
}

impl Section {
    /// The section's name in the dump.
    pub fn name(&self) -> &str {
        match self {
            Section::Process(_) => "process",
            Section::Levels(_) => "levels",
            Section::Resources(_) => "resources",
            Section::Stats(_) => "stats",
            Section::Snapshots(_) => "snapshots",
            Section::FlightRecorder(_) => "flight-recorder",
            Section::Markers(_) => "markers",
            Section::Other { name, .. } => name,
        }
    }

    fn decode(name: &str, body: &[u8]) -> Result<Self, serde_json::Error> {
        Ok(match name {
            "process" => Section::Process(serde_json::from_slice(body)?),
            "levels" => Section::Levels(serde_json::from_slice(body)?),
            "resources" => Section::Resources(serde_json::from_slice(body)?),
            "stats" => Section::Stats(serde_json::from_slice(body)?),
            "snapshots" => Section::Snapshots(serde_json::from_slice(body)?),
            "flight-recorder" => Section::FlightRecorder(serde_json::from_slice(body)?),
            "markers" => Section::Markers(serde_json::from_slice(body)?),
            other => Section::Other {
                name: other.to_string(),
                body: serde_json::from_slice(body)?,
            },
        })
    }

    /// The body as JSON (as it was in the dump).
    pub fn to_json(&self) -> serde_json::Value {
        let v = match self {
            Section::Process(v) => serde_json::to_value(v),
            Section::Levels(v) => serde_json::to_value(v),
            Section::Resources(v) => serde_json::to_value(v),
            Section::Stats(v) => serde_json::to_value(v),
            Section::Snapshots(v) => serde_json::to_value(v),
            Section::FlightRecorder(v) => serde_json::to_value(v),
            Section::Markers(v) => serde_json::to_value(v),
            Section::Other { body, .. } => Ok(body.clone()),
        };
        v.unwrap_or(serde_json::Value::Null)
    }
}

/// What a reader got out of some bytes: every section up to the first problem, and the
/// problem, if any (a sound dump has none).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedDump {
    /// The format version of the header.
    pub version: u32,
    /// The sections decoded, in order.
    pub sections: Vec<Section>,
    /// Why the rest could not be read (`None`: the dump is whole and sound).
    pub error: Option<DumpError>,
}

impl ParsedDump {
    /// Whether the dump was whole and sound.
    pub fn is_complete(&self) -> bool {
        self.error.is_none()
    }

    /// The `process` section.
    pub fn process(&self) -> Option<&DumpProcess> {
        self.sections.iter().find_map(|s| match s {
            Section::Process(p) => Some(p),
            _ => None,
        })
    }
}

/// Whether `bytes` start like a dump (the eye-catcher; says nothing about the rest).
pub fn looks_like_dump(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC.as_bytes())
        && matches!(bytes.get(MAGIC.len()), Some(b' ') | Some(b'\n') | None)
}

/// The line starting at `at` without its newline, and where the next begins; `None` when
/// no newline comes within `max` bytes (`Err(true)`: the data ended first).
fn line_at(bytes: &[u8], at: usize, max: usize) -> Result<(&[u8], usize), bool> {
    let rest = bytes.get(at..).unwrap_or(&[]);
    let window = rest.get(..max.min(rest.len())).unwrap_or(rest);
    match window.iter().position(|b| *b == b'\n') {
        Some(nl) => Ok((window.get(..nl).unwrap_or(&[]), at + nl + 1)),
        None => Err(rest.len() < max),
    }
}

fn shown(line: &[u8]) -> String {
    String::from_utf8_lossy(line.get(..80).unwrap_or(line)).into_owned()
}

enum Marker {
    Section { name: String, len: usize, hash: u64 },
    End(usize),
}

fn parse_marker(line: &[u8]) -> Option<Marker> {
    let text = std::str::from_utf8(line).ok()?;
    if let Some(rest) = text.strip_prefix(SECTION) {
        let rest = rest.strip_suffix(TAIL)?;
        let mut parts = rest.split(' ');
        let name = parts.next()?;
        let len = digits(parts.next()?)?;
        let hex = parts.next()?.strip_prefix("fnv1a64:")?;
        if hex.len() != 16 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let hash = u64::from_str_radix(hex, 16).ok()?;
        if parts.next().is_some() || !valid_name(name) {
            return None;
        }
        return Some(Marker::Section {
            name: name.to_string(),
            len,
            hash,
        });
    }
    let n = digits(text.strip_prefix(END)?.strip_suffix(TAIL)?)?;
    Some(Marker::End(n))
}

/// Reads a dump: every section up to the first problem, and the problem (see
/// [`ParsedDump::error`]). `Err` only when the bytes are not a dump at all (no header, or a
/// version this reader does not know).
pub fn parse(bytes: &[u8]) -> Result<ParsedDump, DumpError> {
    if !looks_like_dump(bytes) {
        return Err(DumpError::NotADump);
    }
    let (header, mut at) = line_at(bytes, 0, MAX_MARKER_LINE).map_err(|_| DumpError::NotADump)?;
    let version = std::str::from_utf8(header)
        .ok()
        .and_then(|h| h.strip_prefix(MAGIC))
        .and_then(|v| v.strip_prefix(' '))
        .and_then(digits)
        .and_then(|v| u32::try_from(v).ok())
        .ok_or(DumpError::NotADump)?;
    if version != VERSION {
        return Err(DumpError::UnsupportedVersion(version));
    }
    let mut out = ParsedDump {
        version,
        sections: Vec::new(),
        error: None,
    };
    loop {
        let start = at;
        let (line, next) = match line_at(bytes, at, MAX_MARKER_LINE) {
            Ok(l) => l,
            Err(true) => {
                out.error = Some(DumpError::Truncated {
                    offset: bytes.len(),
                    what: "no end marker".into(),
                });
                return Ok(out);
            }
            Err(false) => {
                let rest = bytes.get(at..).unwrap_or(&[]);
                out.error = Some(DumpError::BadMarker {
                    offset: at,
                    line: shown(rest),
                });
                return Ok(out);
            }
        };
        match parse_marker(line) {
            Some(Marker::End(n)) => {
                if n != out.sections.len() {
                    out.error = Some(DumpError::SectionCount {
                        expected: n,
                        found: out.sections.len(),
                    });
                } else if next < bytes.len() {
                    out.error = Some(DumpError::TrailingData(bytes.len() - next));
                }
                return Ok(out);
            }
            Some(Marker::Section { name, len, hash }) => {
                if out.sections.len() >= MAX_SECTIONS {
                    out.error = Some(DumpError::TooManySections);
                    return Ok(out);
                }
                let end = next.checked_add(len);
                let body = end.and_then(|e| bytes.get(next..e));
                let newline = end.and_then(|e| bytes.get(e));
                let (Some(body), Some(nl)) = (body, newline) else {
                    out.error = Some(DumpError::Truncated {
                        offset: start,
                        what: format!(
                            "section {name:?} needs {len} bytes, {} are left",
                            bytes.len().saturating_sub(next)
                        ),
                    });
                    return Ok(out);
                };
                if *nl != b'\n' {
                    out.error = Some(DumpError::BadMarker {
                        offset: start,
                        line: format!("section {name:?} is not followed by a newline"),
                    });
                    return Ok(out);
                }
                if section_hash(&name, body) != hash {
                    out.error = Some(DumpError::Checksum {
                        section: name,
                        offset: start,
                    });
                    return Ok(out);
                }
                match Section::decode(&name, body) {
                    Ok(s) => out.sections.push(s),
                    Err(e) => {
                        out.error = Some(DumpError::BadSection {
                            section: name,
                            offset: start,
                            error: e.to_string(),
                        });
                        return Ok(out);
                    }
                }
                at = next + len + 1;
            }
            None => {
                out.error = Some(DumpError::BadMarker {
                    offset: start,
                    line: shown(line),
                });
                return Ok(out);
            }
        }
    }
}

/// Sends `dump` to a TCP collector at `addr` (a plain stream of the dump's bytes, then
/// the connection is closed), each step within `timeout`.
pub fn send_to(addr: &str, dump: &[u8], timeout: Duration) -> io::Result<()> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(mut s) => {
                s.set_write_timeout(Some(timeout))?;
                s.write_all(dump)?;
                s.flush()?;
                return s.shutdown(std::net::Shutdown::Write);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!("{addr} resolves to no address"),
        )
    }))
}

/// Where automatic dumps go and how many are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoDumpConfig {
    /// The directory (the runtime directory).
    pub dir: PathBuf,
    /// Files kept there (the oldest beyond are deleted); 0: no automatic dump.
    pub keep: usize,
    /// Also send each to this TCP collector.
    pub collector: Option<String>,
}

impl AutoDumpConfig {
    /// From the environment: the runtime directory of the running process-wide services
    /// (or of the environment), `SOFTWARP_AUTO_DUMPS`, `SOFTWARP_DUMP_COLLECTOR`. While the
    /// process-wide services do not run ([`service::global`](crate::service::global) is
    /// `None`: nobody asked for RAS), `keep` is 0: no automatic dump, no file.
    pub fn from_env() -> Self {
        let service = crate::service::global();
        let dir = service
            .and_then(|s| s.registry())
            .map(|r| r.dir().to_path_buf())
            .unwrap_or_else(crate::registry::runtime_dir);
        let keep = match std::env::var(AUTO_DUMPS_ENV) {
            _ if service.is_none() => 0,
            Ok(v) if matches!(v.trim(), "off" | "no" | "false") => 0,
            Ok(v) => v.trim().parse().unwrap_or(DEFAULT_AUTO_DUMPS),
            Err(_) => DEFAULT_AUTO_DUMPS,
        };
        let collector = std::env::var(DUMP_COLLECTOR_ENV)
            .ok()
            .filter(|c| !c.trim().is_empty());
        Self {
            dir,
            keep,
            collector,
        }
    }
}

/// Writes an automatic dump of this process (`reason`: why) into `config.dir` as
/// `dump-<unix ms>-<pid>.swdump`, keeps the newest `config.keep` of those files, and sends it
/// to the collector if one is configured. At most one per [`AUTO_DUMP_INTERVAL`]; returns
/// the file written (`None`: off, rate-limited, or it failed, which is traced at level 1).
/// Call it with no lock held: it does file and network I/O.
pub fn auto_dump(
    config: &AutoDumpConfig,
    handler: &dyn ControlHandler,
    reason: &str,
) -> Option<PathBuf> {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    if config.keep == 0 {
        return None;
    }
    {
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < AUTO_DUMP_INTERVAL) {
            crate::sw_event!(Ras, 2, "automatic dump skipped (rate limit): {}", reason);
            return None;
        }
        *last = Some(Instant::now());
    }
    let result = collect(handler, reason).and_then(|bytes| {
        let path = write_rotated(&config.dir, config.keep, &bytes)?;
        if let Some(c) = &config.collector {
            if let Err(e) = send_to(c, &bytes, Duration::from_secs(2)) {
                crate::sw_event!(Ras, 1, "cannot send the automatic dump to {}: {}", c, e);
            }
        }
        Ok(path)
    });
    match result {
        Ok(path) => {
            crate::sw_event!(
                Ras,
                2,
                "automatic dump written to {} ({})",
                path.display(),
                reason
            );
            Some(path)
        }
        Err(e) => {
            crate::sw_event!(
                Ras,
                1,
                "cannot write an automatic dump in {}: {}",
                config.dir.display(),
                e
            );
            None
        }
    }
}

/// Automatic dump files in `dir`, oldest first (their names sort by time).
pub fn auto_dumps_in(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(AUTO_DUMP_PREFIX) && n.ends_with(DUMP_SUFFIX))
        })
        .take(4096)
        .collect();
    files.sort();
    Ok(files)
}

fn write_rotated(dir: &Path, keep: usize, bytes: &[u8]) -> io::Result<PathBuf> {
    crate::registry::ensure_dir(dir)?;
    let ms = clock::unix_ms(std::time::SystemTime::now());
    let path = dir.join(format!(
        "{AUTO_DUMP_PREFIX}{ms:013}-{}{DUMP_SUFFIX}",
        sys::pid()
    ));
    let tmp = path.with_extension("part");
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
    }
    std::fs::rename(&tmp, &path)?;
    let files = auto_dumps_in(dir)?;
    let excess = files.len().saturating_sub(keep);
    for old in files.iter().take(excess) {
        // Another user's file in a shared directory cannot be removed: left alone.
        let _ = std::fs::remove_file(old);
    }
    Ok(path)
}

impl fmt::Display for DumpProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pid {} ({}) softwarp {} at {}: {}",
            self.pid, self.name, self.version, self.time, self.reason
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automatic_dumps_are_off_while_no_service_runs() {
        // No unit test of this crate starts the process-wide services.
        assert!(crate::service::global().is_none());
        assert_eq!(AutoDumpConfig::from_env().keep, 0);
    }
    use crate::control::DefaultHandler;

    fn small() -> Vec<u8> {
        let mut w = DumpWriter::new();
        w.section(
            "process",
            &DumpProcess {
                pid: 1,
                name: "t".into(),
                version: "0".into(),
                time: "now".into(),
                time_unix_ms: 0,
                reason: "test".into(),
            },
        )
        .unwrap();
        w.section("extra-1", &serde_json::json!({"a": [1, 2]}))
            .unwrap();
        w.finish()
    }

    #[test]
    fn a_dump_reads_back_section_by_section() {
        let bytes = small();
        assert!(looks_like_dump(&bytes));
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("SOFTWARP-DUMP 1\n=== SOFTWARP-DUMP SECTION process "));
        assert!(text.ends_with("=== SOFTWARP-DUMP END 2 ===\n"), "{text}");
        let d = parse(&bytes).unwrap();
        assert!(d.is_complete(), "{:?}", d.error);
        assert_eq!(d.process().unwrap().reason, "test");
        assert_eq!(d.sections[1].name(), "extra-1");
        assert_eq!(d.sections[1].to_json()["a"][1], 2);
    }

    #[test]
    fn every_truncation_is_reported_as_truncated_never_as_sound() {
        let bytes = small();
        let header = format!("{MAGIC} {VERSION}\n").len();
        for cut in header..bytes.len() {
            let d = parse(&bytes[..cut]).unwrap();
            assert!(
                matches!(d.error, Some(DumpError::Truncated { .. })),
                "cut at {cut}: {:?}",
                d.error
            );
        }
        for cut in 0..header {
            assert!(parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn damage_and_strangers_are_typed_errors() {
        let mut bytes = small();
        let body = bytes.iter().position(|b| *b == b'{').unwrap();
        bytes[body + 2] ^= 0x20;
        assert!(matches!(
            parse(&bytes).unwrap().error,
            Some(DumpError::Checksum { .. })
        ));
        assert_eq!(parse(b"\xd4\xc3\xb2\xa1"), Err(DumpError::NotADump));
        assert_eq!(
            parse(b"SOFTWARP-DUMP 7\n"),
            Err(DumpError::UnsupportedVersion(7))
        );
        let mut extra = small();
        extra.extend_from_slice(b"junk");
        assert_eq!(
            parse(&extra).unwrap().error,
            Some(DumpError::TrailingData(4))
        );
        let d = parse(
            b"SOFTWARP-DUMP 1\n=== SOFTWARP-DUMP SECTION x 99999999999999999999 fnv1a64:0 ===\n",
        )
        .unwrap();
        assert!(
            matches!(d.error, Some(DumpError::BadMarker { .. })),
            "{d:?}"
        );
        let d = parse(b"SOFTWARP-DUMP 1\n=== SOFTWARP-DUMP SECTION levels 2 fnv1a64:08b50607b2e3b7ca ===\n{}\n").unwrap();
        assert!(
            matches!(
                d.error,
                Some(DumpError::Checksum { .. }) | Some(DumpError::BadSection { .. })
            ),
            "{d:?}"
        );
    }

    #[test]
    fn the_process_state_is_collected_into_every_section() {
        crate::sw_event!(Ras, 1, "dump collect test record");
        let bytes = collect(&DefaultHandler, "unit test").unwrap();
        let d = parse(&bytes).unwrap();
        assert!(d.is_complete(), "{:?}", d.error);
        let names: Vec<&str> = d.sections.iter().map(Section::name).collect();
        assert_eq!(
            names,
            [
                "process",
                "levels",
                "resources",
                "stats",
                "snapshots",
                "flight-recorder",
                "markers"
            ]
        );
    }

    #[test]
    fn automatic_dumps_are_rotated() {
        let dir = std::env::temp_dir().join(format!("swras-dump-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for _ in 0..5 {
            write_rotated(&dir, 3, &small()).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        let files = auto_dumps_in(&dir).unwrap();
        assert_eq!(files.len(), 3, "{files:?}");
        for f in files {
            assert!(parse(&std::fs::read(f).unwrap()).unwrap().is_complete());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
