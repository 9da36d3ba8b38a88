//! JSON Lines form of decode records: one object per MPA frame, FPDU or error.
//!
//! STags, tagged offsets and CRC fields are hex strings (a tagged offset does not fit the
//! 53-bit integers JSON readers assume); lengths and counters are numbers. Written by hand to
//! keep the dependency list short; only strings we produce or error messages are escaped.

use std::fmt::Write as _;

use super::record::{CrcRecord, FpduRecord, Item, MpaFrameRecord, Placement, Record};
use super::Output;

/// Appends `s` as a JSON string literal.
fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Builds one JSON object field by field.
struct Object<'a> {
    out: &'a mut String,
    first: bool,
}

impl<'a> Object<'a> {
    fn new(out: &'a mut String) -> Self {
        out.push('{');
        Self { out, first: true }
    }
    fn key(&mut self, key: &str) -> &mut String {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        string(self.out, key);
        self.out.push(':');
        self.out
    }
    fn num(&mut self, key: &str, value: impl std::fmt::Display) -> &mut Self {
        let out = self.key(key);
        let _ = write!(out, "{value}");
        self
    }
    fn str(&mut self, key: &str, value: &str) -> &mut Self {
        let out = self.key(key);
        string(out, value);
        self
    }
    fn bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.key(key).push_str(if value { "true" } else { "false" });
        self
    }
    fn hex32(&mut self, key: &str, value: u32) -> &mut Self {
        self.str(key, &format!("0x{value:08x}"))
    }
    fn hex64(&mut self, key: &str, value: u64) -> &mut Self {
        self.str(key, &format!("0x{value:016x}"))
    }
    fn object(&mut self, key: &str, fill: impl FnOnce(&mut Object<'_>)) -> &mut Self {
        let out = self.key(key);
        let mut inner = Object::new(out);
        fill(&mut inner);
        inner.close();
        self
    }
    fn close(&mut self) {
        self.out.push('}');
    }
}

fn mpa_frame(o: &mut Object<'_>, m: &MpaFrameRecord) {
    o.str(
        "kind",
        if m.request {
            "mpa_request"
        } else {
            "mpa_reply"
        },
    )
    .num("revision", m.revision)
    .bool("markers", m.markers)
    .bool("crc", m.crc)
    .bool("reject", m.reject)
    .num("res", m.res)
    .str("private_data", &hex(&m.private_data));
    if let Some(e) = &m.enhanced {
        o.object("enhanced", |o| {
            o.num("ird", e.ird)
                .num("ord", e.ord)
                .bool("p2p", e.p2p)
                .bool("rtr_send", e.rtr_send)
                .bool("rtr_write", e.rtr_write)
                .bool("rtr_read", e.rtr_read);
        });
    }
}

fn fpdu(o: &mut Object<'_>, p: &FpduRecord) {
    o.str("kind", "fpdu")
        .num("ulpdu_len", p.ulpdu_len)
        .str("pad", &hex(&p.pad))
        .num("markers", p.markers);
    o.object("crc", |o| match p.crc {
        CrcRecord::Off { field } => {
            o.str("state", "off").hex32("field", field);
        }
        CrcRecord::Good { field } => {
            o.str("state", "good").hex32("field", field);
        }
        CrcRecord::Bad { field, expected } => {
            o.str("state", "bad")
                .hex32("field", field)
                .hex32("expected", expected);
        }
    });
    match &p.segment {
        Err(e) => {
            o.str("segment_error", e);
        }
        Ok(s) => {
            o.object("segment", |o| {
                o.str("opcode", &s.opcode).bool("last", s.last);
                match s.placement {
                    Placement::Tagged { stag, to } => {
                        o.bool("tagged", true).hex32("stag", stag).hex64("to", to);
                    }
                    Placement::Untagged { qn, msn, mo } => {
                        o.bool("tagged", false)
                            .num("qn", qn)
                            .num("msn", msn)
                            .num("mo", mo);
                    }
                }
                if let Some(r) = &s.read_request {
                    o.object("read_request", |o| {
                        o.hex32("sink_stag", r.sink_stag)
                            .hex64("sink_to", r.sink_to)
                            .num("size", r.size)
                            .hex32("src_stag", r.src_stag)
                            .hex64("src_to", r.src_to);
                    });
                }
                if let Some(inv) = s.invalidate_stag {
                    o.hex32("invalidate_stag", inv);
                }
                if let Some(t) = &s.terminate {
                    o.object("terminate", |o| {
                        o.num("layer", t.layer)
                            .num("etype", t.etype)
                            .num("code", t.code)
                            .bool("m", t.m)
                            .bool("d", t.d)
                            .bool("r", t.r)
                            .num("reserved", t.reserved)
                            .str("layout", if t.siw_layout { "linux_siw" } else { "rfc5040" })
                            .str("description", &t.description);
                    });
                }
                o.num("payload_len", s.payload_len);
            });
        }
    }
}

/// The record as one line of JSON (no trailing newline).
pub fn to_json(r: &Record) -> String {
    let mut out = String::new();
    let mut o = Object::new(&mut out);
    o.num("frame", r.frame)
        .num("first_frame", r.first_frame)
        .num("connection", r.connection)
        .str("src", &r.src.to_string())
        .str("dst", &r.dst.to_string())
        .num("stream_offset", r.stream_offset)
        .num("wire_len", r.wire_len);
    match &r.item {
        Item::MpaFrame(m) => mpa_frame(&mut o, m),
        Item::Fpdu(p) => fpdu(&mut o, p),
        Item::Error(e) => {
            o.str("kind", "error")
                .str("message", &e.message)
                .bool("fatal", e.fatal);
        }
    }
    o.close();
    out
}

/// Any decode output as one line of JSON: a [`Record`] as [`to_json`] writes it, a capture
/// error as `{"kind":"capture_error","message":...}`.
pub fn output_to_json(output: &Output) -> String {
    match output {
        Output::Record(r) => to_json(r),
        Output::CaptureError(e) => {
            let mut out = String::new();
            let mut o = Object::new(&mut out);
            o.str("kind", "capture_error")
                .str("message", &e.to_string());
            o.close();
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::*;
    use super::*;

    #[test]
    fn capture_errors_become_json_objects() {
        let e =
            Output::CaptureError(crate::capture::CaptureError::TruncatedRecord { after_frame: 3 });
        assert_eq!(
            output_to_json(&e),
            r#"{"kind":"capture_error","message":"capture ends in the middle of the record after frame 3"}"#
        );
    }

    #[test]
    fn strings_are_escaped() {
        let mut s = String::new();
        string(&mut s, "a\"b\\c\nd\u{1}");
        assert_eq!(s, r#""a\"b\\c\nd\u0001""#);
    }

    #[test]
    fn an_fpdu_becomes_one_json_object() {
        let r = Record {
            frame: 10,
            first_frame: 9,
            connection: 1,
            src: "10.0.0.1:1".parse().unwrap(),
            dst: "[::1]:2".parse().unwrap(),
            stream_offset: 100,
            wire_len: 24,
            bytes: vec![],
            item: Item::Fpdu(FpduRecord {
                ulpdu_len: 18,
                pad: vec![],
                markers: 0,
                crc: CrcRecord::Bad {
                    field: 1,
                    expected: 2,
                },
                segment: Ok(SegmentRecord {
                    opcode: "Write".into(),
                    last: true,
                    placement: Placement::Tagged { stag: 1, to: 2 },
                    read_request: None,
                    invalidate_stag: None,
                    terminate: None,
                    payload_len: 4,
                }),
            }),
        };
        assert_eq!(
            to_json(&r),
            concat!(
                r#"{"frame":10,"first_frame":9,"connection":1,"src":"10.0.0.1:1","dst":"[::1]:2","#,
                r#""stream_offset":100,"wire_len":24,"kind":"fpdu","ulpdu_len":18,"pad":"","markers":0,"#,
                r#""crc":{"state":"bad","field":"0x00000001","expected":"0x00000002"},"#,
                r#""segment":{"opcode":"Write","last":true,"tagged":true,"stag":"0x00000001","#,
                r#""to":"0x0000000000000002","payload_len":4}}"#
            )
        );
    }

    #[test]
    fn errors_and_mpa_frames_become_json_objects() {
        let mut r = Record {
            frame: 1,
            first_frame: 1,
            connection: 0,
            src: "10.0.0.1:1".parse().unwrap(),
            dst: "10.0.0.2:2".parse().unwrap(),
            stream_offset: 0,
            wire_len: 0,
            bytes: vec![],
            item: Item::Error(ErrorRecord {
                message: "bad \"key\"".into(),
                fatal: true,
            }),
        };
        assert!(to_json(&r).ends_with(r#""kind":"error","message":"bad \"key\"","fatal":true}"#));
        r.item = Item::MpaFrame(MpaFrameRecord {
            request: false,
            revision: 2,
            markers: false,
            crc: true,
            reject: false,
            res: 0x10,
            private_data: vec![0, 1, 0, 1],
            enhanced: Some(EnhancedRecord {
                ird: 1,
                ord: 1,
                p2p: false,
                rtr_send: false,
                rtr_write: false,
                rtr_read: false,
            }),
        });
        let j = to_json(&r);
        assert!(j.contains(r#""kind":"mpa_reply","revision":2"#));
        assert!(j.contains(r#""private_data":"00010001","enhanced":{"ird":1,"ord":1"#));
    }
}
