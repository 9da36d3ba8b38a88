//! `softwarp decode` of a component dump (recognised by its eye-catcher, see
//! `softwarp_ras::dump`): every section as readable text, or the whole dump as one JSON
//! object; a truncated or damaged dump prints what could be read and says what is wrong.
//! No I/O besides writing the text.

use std::io::{self, Write};

use softwarp_ras::dump::{ParsedDump, Section};

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
            other => {
                let text = serde_json::to_string_pretty(&other.to_json())
                    .unwrap_or_else(|e| format!("(cannot print: {e})"));
                writeln!(out, "{text}")?;
            }
        }
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

/// The dump as one JSON object: `{format, version, complete, error, sections: [{name,
/// body}]}`.
pub fn to_json(dump: &ParsedDump) -> serde_json::Value {
    serde_json::json!({
        "format": "softwarp-dump",
        "version": dump.version,
        "complete": dump.is_complete(),
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
            text.ends_with("the dump is complete (6 sections) ==\n"),
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
}
