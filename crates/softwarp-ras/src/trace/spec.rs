//! The text form of trace settings, shared by `SOFTWARP_TRACE`, the control socket's
//! `trace-set` and the CLI (grammar on [`TraceSpec`]). Pure parsing and printing.

use std::fmt;
use std::str::FromStr;

use super::{Component, Level};

/// Longest spec accepted, in bytes (keeps parsing bounded).
pub const MAX_SPEC_LEN: usize = 4096;

/// Why a spec could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The spec is longer than [`MAX_SPEC_LEN`].
    #[error("trace spec of {0} bytes is longer than {MAX_SPEC_LEN}")]
    TooLong(usize),
    /// An item has no `=level`.
    #[error("trace spec item {0:?} has no `=level`")]
    MissingLevel(String),
    /// A level is not 0-9 or `off`.
    #[error("trace level {0:?} is not 0-9 or off")]
    BadLevel(String),
    /// The key is not a component, `default`, `all`, `other`, `recorder` or `qpn:<n>`.
    #[error("unknown trace key {0:?} (components: wire engine qp cq mr cm runtime sockets ras; also default, other, recorder, qpn:<n>)")]
    UnknownKey(String),
    /// `qpn:` is not followed by a QP number (or `*` with `off`).
    #[error("bad QP number in {0:?}")]
    BadQpn(String),
}

/// Parsed trace settings, and their text form.
///
/// Grammar: items separated by commas, each `key=level`, spaces around items ignored.
///
/// | key | sets |
/// | --- | --- |
/// | `wire`, `engine`, `qp`, `cq`, `mr`, `cm`, `runtime`, `sockets`, `ras` | that component |
/// | `default` (or `all`) | every component and `other` (applied before the other items) |
/// | `other` | events of other crates |
/// | `recorder` | the flight recorder's own level |
/// | `qpn:<n>` | QP number `n` (decimal or `0x` hex); `off` removes its own level |
/// | `qpn:*` | only with `off`: removes every QP's own level |
///
/// A level is `0`-`9` or `off` (= 0). Example: `qp=5,cq=2,default=1,qpn:17=9,recorder=6`.
/// [`Display`](fmt::Display) prints a spec that parses back to the same value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TraceSpec {
    /// `default=`: every component and `other`, applied first.
    pub default: Option<Level>,
    /// Component levels, in the order given.
    pub components: Vec<(Component, Level)>,
    /// `other=`: events of other crates.
    pub other: Option<Level>,
    /// `recorder=`: the flight recorder's own level.
    pub recorder: Option<Level>,
    /// `qpn:*=off`: remove every QP's own level (before the `qps` below).
    pub clear_qps: bool,
    /// `qpn:<n>=`: per-QP levels, in the order given ([`Level::OFF`] removes).
    pub qps: Vec<(u32, Level)>,
}

fn parse_level(s: &str) -> Result<Level, SpecError> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(Level::OFF);
    }
    s.parse::<u8>()
        .ok()
        .and_then(Level::new)
        .ok_or_else(|| SpecError::BadLevel(s.to_string()))
}

fn parse_qpn(s: &str) -> Option<u32> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

impl FromStr for TraceSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_SPEC_LEN {
            return Err(SpecError::TooLong(s.len()));
        }
        let mut spec = TraceSpec::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| SpecError::MissingLevel(item.to_string()))?;
            let (key, value) = (key.trim(), value.trim());
            let level = parse_level(value)?;
            if let Some(q) = key.strip_prefix("qpn:") {
                let q = q.trim();
                if q == "*" {
                    if level != Level::OFF {
                        return Err(SpecError::BadQpn(item.to_string()));
                    }
                    spec.clear_qps = true;
                } else {
                    let qpn = parse_qpn(q).ok_or_else(|| SpecError::BadQpn(item.to_string()))?;
                    spec.qps.push((qpn, level));
                }
                continue;
            }
            match key {
                "default" | "all" => spec.default = Some(level),
                "other" => spec.other = Some(level),
                "recorder" => spec.recorder = Some(level),
                _ => {
                    let c = Component::from_name(key)
                        .ok_or_else(|| SpecError::UnknownKey(key.to_string()))?;
                    spec.components.push((c, level));
                }
            }
        }
        Ok(spec)
    }
}

impl fmt::Display for TraceSpec {
    /// The spec in the text form [`TraceSpec::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<String> = Vec::new();
        if let Some(l) = self.default {
            items.push(format!("default={l}"));
        }
        items.extend(self.components.iter().map(|(c, l)| format!("{c}={l}")));
        if let Some(l) = self.other {
            items.push(format!("other={l}"));
        }
        if let Some(l) = self.recorder {
            items.push(format!("recorder={l}"));
        }
        if self.clear_qps {
            items.push("qpn:*=off".to_string());
        }
        items.extend(self.qps.iter().map(|(q, l)| format!("qpn:{q}={l}")));
        f.write_str(&items.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses() {
        let s: TraceSpec = "qp=5, cq=2 ,default=1,qpn:17=9,recorder=6,qpn:0x20=off,other=off"
            .parse()
            .unwrap();
        assert_eq!(s.default, Some(Level::ERROR));
        assert_eq!(
            s.components,
            vec![
                (Component::Qp, Level::INTERNALS),
                (Component::Cq, Level::RARE)
            ]
        );
        assert_eq!(s.qps, vec![(17, Level::DATA), (0x20, Level::OFF)]);
        assert_eq!(s.recorder, Level::new(6));
        assert_eq!(s.other, Some(Level::OFF));
        assert!(!s.clear_qps);
    }

    #[test]
    fn empty_spec_changes_nothing() {
        assert_eq!("".parse::<TraceSpec>().unwrap(), TraceSpec::default());
        assert_eq!(" , ,".parse::<TraceSpec>().unwrap(), TraceSpec::default());
    }

    #[test]
    fn malformed_items_are_refused_with_the_reason() {
        assert_eq!(
            "qp".parse::<TraceSpec>(),
            Err(SpecError::MissingLevel("qp".into()))
        );
        assert_eq!(
            "qp=10".parse::<TraceSpec>(),
            Err(SpecError::BadLevel("10".into()))
        );
        assert_eq!(
            "qp=-1".parse::<TraceSpec>(),
            Err(SpecError::BadLevel("-1".into()))
        );
        assert_eq!(
            "disk=3".parse::<TraceSpec>(),
            Err(SpecError::UnknownKey("disk".into()))
        );
        assert_eq!(
            "qpn:x=3".parse::<TraceSpec>(),
            Err(SpecError::BadQpn("qpn:x=3".into()))
        );
        assert_eq!(
            "qpn:4294967296=3".parse::<TraceSpec>(),
            Err(SpecError::BadQpn("qpn:4294967296=3".into()))
        );
        assert_eq!(
            "qpn:*=3".parse::<TraceSpec>(),
            Err(SpecError::BadQpn("qpn:*=3".into()))
        );
        let long = "qp=1,".repeat(1000);
        assert_eq!(
            long.parse::<TraceSpec>(),
            Err(SpecError::TooLong(long.len()))
        );
    }

    #[test]
    fn display_reads_back_as_the_same_spec() {
        let s: TraceSpec = "all=3,ras=9,other=0,recorder=7,qpn:*=off,qpn:5=4"
            .parse()
            .unwrap();
        assert!(s.clear_qps);
        assert_eq!(s.to_string().parse::<TraceSpec>().unwrap(), s);
    }
}
