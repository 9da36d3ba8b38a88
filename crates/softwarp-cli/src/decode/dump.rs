//! `softwarp decode` of a component dump (recognised by its eye-catcher, see
//! `softwarp_ras::dump`): every section as readable text, or the whole dump as one JSON
//! object; a truncated or damaged dump prints what could be read and says what is wrong.
//! No I/O besides writing the text.

use std::io::{self, Write};

use softwarp_ras::dump::{ParsedDump, Section};
use softwarp_ras::markers::MarkerWord;

/// Writes `dump` as text: one `== <section> ==` heading per section, then the state in the
/// form the operator commands print it, and a last line that says whether the dump is
/// whole.
pub fn write_text(dump: &ParsedDump, out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, "Softwarp component dump, format {}", dump.version)?;
    for s in &dump.sections {
        writeln!(out, "== {} ==", s.name())?;
        match s {
            Section::Process(p) => writeln!(out, "{p}")?,
            Section::Levels(l) => writeln!(out, "{}", l.to_spec())?,
            Section::Resources(r) => {
                for res in &r.resources {
                    let d = res.details.clone().unwrap_or_default();
                    let addr = |a: Option<std::net::SocketAddr>| {
                        a.map_or_else(|| "-".to_string(), |a| a.to_string())
                    };
                    let attrs: Vec<String> =
                        d.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    writeln!(
                        out,
                        "{} {} {} state {} local {} peer {} bytes {} created {} by {} {}",
                        res.tracker,
                        res.kind,
                        res.id,
                        d.state.as_deref().unwrap_or("-"),
                        addr(d.local_addr),
                        addr(d.peer_addr),
                        res.bytes,
                        res.created,
                        res.thread,
                        res.location()
                    )?;
                    if !attrs.is_empty() {
                        writeln!(out, "    {}", attrs.join(" "))?;
                    }
                    if !d.markers.is_empty() {
                        let words: Vec<String> =
                            d.markers.iter().map(ToString::to_string).collect();
                        let flag = if d.markers.iter().all(MarkerWord::is_intact) {
                            ""
                        } else {
                            "MARKERS DAMAGED: "
                        };
                        writeln!(out, "    {flag}markers {}", words.join(" "))?;
                    }
                }
                for m in &r.memory {
                    writeln!(out, "memory {}: {} bytes", m.tracker, m.total_bytes)?;
                }
            }
            Section::Stats(st) => out.write_all(st.to_prometheus().as_bytes())?,
            Section::Snapshots(r) => {
                writeln!(
                    out,
                    "{} snapshots, {} taken, {} dropped (keeps {})",
                    r.snapshots.len(),
                    r.taken,
                    r.dropped,
                    r.capacity
                )?;
                for snap in &r.snapshots {
                    write!(out, "{snap}")?;
                }
            }
            Section::FlightRecorder(f) => {
                writeln!(
                    out,
                    "{} records (capacity {}, {} evicted, next seq {})",
                    f.records.len(),
                    f.capacity,
                    f.evicted,
                    f.next_seq
                )?;
                for r in &f.records {
                    writeln!(out, "{r}")?;
                }
            }
            Section::Markers(m) => {
                writeln!(
                    out,
                    "{} damaged structure marker(s) found by checks ({} recorded here)",
                    m.detected,
                    m.damage.len()
                )?;
                for d in &m.damage {
                    writeln!(out, "DAMAGED {d}")?;
                }
            }
            other => {
                let text = serde_json::to_string_pretty(&other.to_json())
                    .unwrap_or_else(|e| format!("(cannot print: {e})"));
                writeln!(out, "{text}")?;
            }
        }
    }
    let damaged = damaged_markers(dump);
    if damaged > 0 {
        writeln!(
            out,
            "== {damaged} DAMAGED STRUCTURE MARKER(S): the process's memory was written over (see above) =="
        )?;
    }
    match &dump.error {
        None => writeln!(
            out,
            "== end: the dump is complete ({} sections) ==",
            dump.sections.len()
        ),
        Some(e) => writeln!(out, "== end: DUMP INCOMPLETE: {e} =="),
    }
}

/// Damaged structure markers in a dump: words of live resources that do not hold what
/// they must, plus the damage records of the `markers` section.
pub fn damaged_markers(dump: &ParsedDump) -> usize {
    dump.sections
        .iter()
        .map(|s| match s {
            Section::Resources(r) => r
                .resources
                .iter()
                .filter_map(|res| res.details.as_ref())
                .flat_map(|d| d.markers.iter())
                .filter(|w| !w.is_intact())
                .count(),
            Section::Markers(m) => m.damage.len(),
            _ => 0,
        })
        .sum()
}

/// The dump as one JSON object: `{format, version, complete, error, damaged_markers,
/// sections: [{name, body}]}`.
pub fn to_json(dump: &ParsedDump) -> serde_json::Value {
    serde_json::json!({
        "format": "softwarp-dump",
        "version": dump.version,
        "complete": dump.is_complete(),
        "damaged_markers": damaged_markers(dump),
        "error": dump.error.as_ref().map(ToString::to_string),
        "sections": dump
            .sections
            .iter()
            .map(|s| serde_json::json!({"name": s.name(), "body": s.to_json()}))
            .collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use softwarp_ras::control::DefaultHandler;
    use softwarp_ras::dump;

    #[test]
    fn a_dump_prints_every_section_and_says_whether_it_is_whole() {
        let bytes = dump::collect(&DefaultHandler, "test").unwrap();
        let d = dump::parse(&bytes).unwrap();
        let mut out = Vec::new();
        write_text(&d, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for s in ["process", "levels", "resources", "stats", "snapshots"] {
            assert!(text.contains(&format!("== {s} ==")), "{s}: {text}");
        }
        assert!(
            text.ends_with("the dump is complete (7 sections) ==\n"),
            "{text}"
        );
        let cut = dump::parse(&bytes[..bytes.len() - 10]).unwrap();
        let mut out = Vec::new();
        write_text(&cut, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("DUMP INCOMPLETE: the dump is truncated"),
            "{text}"
        );
        let j = to_json(&cut);
        assert_eq!(j["complete"], false);
        assert_eq!(j["sections"][0]["name"], "process");
    }

    #[test]
    fn damaged_structure_markers_are_flagged() {
        use softwarp_ras::control::ResourcesResult;
        use softwarp_ras::markers::{MarkerDamage, MarkersResult};
        use softwarp_ras::tracker::{ResourceDetails, ResourceInfo, ResourceKind};
        let word = u64::from_le_bytes(*b"SWQP-BEG");
        let mut w = dump::DumpWriter::new();
        let details = ResourceDetails {
            markers: vec![
                MarkerWord::new("begin", word, word ^ 1),
                MarkerWord::new("end", 7, 7),
            ],
            ..ResourceDetails::default()
        };
        let res = ResourceInfo {
            tracker: "softwarp0/1".into(),
            kind: ResourceKind::Qp,
            id: 5,
            pid: 1,
            process: "p".into(),
            thread: "t".into(),
            tid: 1,
            file: "f.rs".into(),
            line: 1,
            column: 1,
            created_unix_ms: 0,
            created: "-".into(),
            caller: None,
            bytes: 0,
            details: Some(details),
        };
        w.section(
            "resources",
            &ResourcesResult {
                resources: vec![res],
                memory: vec![],
                omitted: 0,
            },
        )
        .unwrap();
        w.section(
            "markers",
            &MarkersResult {
                damage: vec![MarkerDamage {
                    device: "softwarp0/1".into(),
                    object: "qp".into(),
                    id: 5,
                    marker: MarkerWord::new("begin", word, word ^ 1),
                    check: "QueuePair::post_send".into(),
                    time_unix_ms: 0,
                }],
                detected: 1,
            },
        )
        .unwrap();
        let d = dump::parse(&w.finish()).unwrap();
        assert_eq!(damaged_markers(&d), 2);
        let mut out = Vec::new();
        write_text(&d, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains(
                "MARKERS DAMAGED: markers begin=DAMAGED(found RWQP-BEG, expected SWQP-BEG)"
            ),
            "{text}"
        );
        assert!(text.contains("end=0x0000000000000007"), "{text}");
        assert!(
            text.contains("DAMAGED softwarp0/1 qp 5: begin=DAMAGED"),
            "{text}"
        );
        assert!(text.contains("== 2 DAMAGED STRUCTURE MARKER(S)"), "{text}");
        assert_eq!(to_json(&d)["damaged_markers"], 2);
    }
}
