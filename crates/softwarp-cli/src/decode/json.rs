//! JSON Lines form of decode records: one object per MPA frame, FPDU or error.
//!
//! STags, tagged offsets and CRC fields are hex strings (a tagged offset does not fit the
//! 53-bit integers JSON readers assume); lengths and counters are numbers. The objects are
//! serde views that borrow the records (serde_json writes them and escapes the strings);
//! the views fix the field names and their order, which the tests pin.

use std::fmt;

use serde::{Serialize, Serializer};

use super::record::{
    CrcRecord, EnhancedRecord, FpduRecord, Item, MpaFrameRecord, Placement, ReadRequestRecord,
    Record, SegmentRecord, TerminateRecord,
};
use super::Output;

/// Bytes as lower-case hex digits, written straight into the JSON string.
struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

fn hex_bytes<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&Hex(v))
}

fn hex32<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("0x{v:08x}"))
}

fn hex64<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("0x{v:016x}"))
}

/// An optional hex field (the field is skipped when absent).
fn opt_hex32<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => hex32(v, s),
        None => s.serialize_none(),
    }
}

fn opt_hex64<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => hex64(v, s),
        None => s.serialize_none(),
    }
}

#[derive(Serialize)]
struct RecordJson<'a> {
    frame: u64,
    first_frame: u64,
    connection: usize,
    src: String,
    dst: String,
    stream_offset: u64,
    wire_len: usize,
    #[serde(flatten)]
    item: ItemJson<'a>,
}

#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum ItemJson<'a> {
    MpaRequest(MpaJson<'a>),
    MpaReply(MpaJson<'a>),
    Fpdu(FpduJson<'a>),
    Error { message: &'a str, fatal: bool },
    CaptureError { message: String },
}

#[derive(Serialize)]
struct MpaJson<'a> {
    revision: u8,
    markers: bool,
    crc: bool,
    reject: bool,
    res: u8,
    #[serde(serialize_with = "hex_bytes")]
    private_data: &'a [u8],
    #[serde(skip_serializing_if = "Option::is_none")]
    enhanced: Option<EnhancedJson>,
}

/// RFC 6581's fields of an MPA frame.
#[derive(Serialize)]
struct EnhancedJson {
    ird: u16,
    ord: u16,
    p2p: bool,
    rtr_send: bool,
    rtr_write: bool,
    rtr_read: bool,
}

#[derive(Serialize)]
struct FpduJson<'a> {
    ulpdu_len: u16,
    #[serde(serialize_with = "hex_bytes")]
    pad: &'a [u8],
    markers: usize,
    crc: CrcJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    segment_error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    segment: Option<SegmentJson<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "state", rename_all = "lowercase")]
enum CrcJson {
    Off {
        #[serde(serialize_with = "hex32")]
        field: u32,
    },
    Good {
        #[serde(serialize_with = "hex32")]
        field: u32,
    },
    Bad {
        #[serde(serialize_with = "hex32")]
        field: u32,
        #[serde(serialize_with = "hex32")]
        expected: u32,
    },
}

#[derive(Serialize)]
struct SegmentJson<'a> {
    opcode: &'a str,
    last: bool,
    tagged: bool,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "opt_hex32")]
    stag: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "opt_hex64")]
    to: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    qn: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    msn: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mo: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    read_request: Option<ReadRequestJson>,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "opt_hex32")]
    invalidate_stag: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    terminate: Option<TerminateJson<'a>>,
    payload_len: usize,
}

#[derive(Serialize)]
struct ReadRequestJson {
    #[serde(serialize_with = "hex32")]
    sink_stag: u32,
    #[serde(serialize_with = "hex64")]
    sink_to: u64,
    size: u32,
    #[serde(serialize_with = "hex32")]
    src_stag: u32,
    #[serde(serialize_with = "hex64")]
    src_to: u64,
}

#[derive(Serialize)]
struct TerminateJson<'a> {
    layer: u8,
    etype: u8,
    code: u8,
    m: bool,
    d: bool,
    r: bool,
    reserved: u16,
    layout: &'static str,
    description: &'a str,
}

fn mpa_frame(m: &MpaFrameRecord) -> ItemJson<'_> {
    let j = MpaJson {
        revision: m.revision,
        markers: m.markers,
        crc: m.crc,
        reject: m.reject,
        res: m.res,
        private_data: &m.private_data,
        enhanced: m.enhanced.as_ref().map(enhanced),
    };
    if m.request {
        ItemJson::MpaRequest(j)
    } else {
        ItemJson::MpaReply(j)
    }
}

fn enhanced(e: &EnhancedRecord) -> EnhancedJson {
    EnhancedJson {
        ird: e.ird,
        ord: e.ord,
        p2p: e.p2p,
        rtr_send: e.rtr_send,
        rtr_write: e.rtr_write,
        rtr_read: e.rtr_read,
    }
}

fn crc(c: CrcRecord) -> CrcJson {
    match c {
        CrcRecord::Off { field } => CrcJson::Off { field },
        CrcRecord::Good { field } => CrcJson::Good { field },
        CrcRecord::Bad { field, expected } => CrcJson::Bad { field, expected },
    }
}

fn read_request(r: &ReadRequestRecord) -> ReadRequestJson {
    ReadRequestJson {
        sink_stag: r.sink_stag,
        sink_to: r.sink_to,
        size: r.size,
        src_stag: r.src_stag,
        src_to: r.src_to,
    }
}

fn terminate(t: &TerminateRecord) -> TerminateJson<'_> {
    TerminateJson {
        layer: t.layer,
        etype: t.etype,
        code: t.code,
        m: t.m,
        d: t.d,
        r: t.r,
        reserved: t.reserved,
        layout: if t.siw_layout { "linux_siw" } else { "rfc5040" },
        description: &t.description,
    }
}

fn segment(s: &SegmentRecord) -> SegmentJson<'_> {
    let (tagged, stag, to, qn, msn, mo) = match s.placement {
        Placement::Tagged { stag, to } => (true, Some(stag), Some(to), None, None, None),
        Placement::Untagged { qn, msn, mo } => (false, None, None, Some(qn), Some(msn), Some(mo)),
    };
    SegmentJson {
        opcode: &s.opcode,
        last: s.last,
        tagged,
        stag,
        to,
        qn,
        msn,
        mo,
        read_request: s.read_request.as_ref().map(read_request),
        invalidate_stag: s.invalidate_stag,
        terminate: s.terminate.as_ref().map(terminate),
        payload_len: s.payload_len,
    }
}

fn fpdu(p: &FpduRecord) -> ItemJson<'_> {
    ItemJson::Fpdu(FpduJson {
        ulpdu_len: p.ulpdu_len,
        pad: &p.pad,
        markers: p.markers,
        crc: crc(p.crc),
        segment_error: p.segment.as_ref().err().map(String::as_str),
        segment: p.segment.as_ref().ok().map(segment),
    })
}

/// One JSON line. serde_json fails only on a map with keys that are not strings or a
/// `Serialize` impl that reports an error; these views have neither, so the empty string of
/// the error branch is never returned.
fn line(v: &impl Serialize) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// The record as one line of JSON (no trailing newline).
pub fn to_json(r: &Record) -> String {
    let item = match &r.item {
        Item::MpaFrame(m) => mpa_frame(m),
        Item::Fpdu(p) => fpdu(p),
        Item::Error(e) => ItemJson::Error {
            message: &e.message,
            fatal: e.fatal,
        },
    };
    line(&RecordJson {
        frame: r.frame,
        first_frame: r.first_frame,
        connection: r.connection,
        src: r.src.to_string(),
        dst: r.dst.to_string(),
        stream_offset: r.stream_offset,
        wire_len: r.wire_len,
        item,
    })
}

/// Any decode output as one line of JSON: a [`Record`] as [`to_json`] writes it, a capture
/// error as `{"kind":"capture_error","message":...}`.
pub fn output_to_json(output: &Output) -> String {
    match output {
        Output::Record(r) => to_json(r),
        Output::CaptureError(e) => line(&ItemJson::CaptureError {
            message: e.to_string(),
        }),
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
        let e = ItemJson::Error {
            message: "a\"b\\c\nd\u{1}",
            fatal: false,
        };
        assert_eq!(
            line(&e),
            r#"{"kind":"error","message":"a\"b\\c\nd\u0001","fatal":false}"#
        );
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

    #[test]
    fn an_untagged_segment_keeps_every_field_in_the_order_of_the_hand_written_form() {
        let segment = SegmentRecord {
            opcode: "Read Request".into(),
            last: true,
            placement: Placement::Untagged {
                qn: 1,
                msn: 2,
                mo: 0,
            },
            read_request: Some(ReadRequestRecord {
                sink_stag: 0x10,
                sink_to: 0x20,
                size: 64,
                src_stag: 0x30,
                src_to: 0x40,
            }),
            invalidate_stag: Some(0xab),
            terminate: Some(TerminateRecord {
                layer: 1,
                etype: 2,
                code: 3,
                m: true,
                d: false,
                r: true,
                reserved: 0,
                siw_layout: true,
                description: "x".into(),
            }),
            payload_len: 28,
        };
        let mut r = Record {
            frame: 2,
            first_frame: 2,
            connection: 0,
            src: "10.0.0.1:1".parse().unwrap(),
            dst: "10.0.0.2:2".parse().unwrap(),
            stream_offset: 0,
            wire_len: 40,
            bytes: vec![],
            item: Item::Fpdu(FpduRecord {
                ulpdu_len: 28,
                pad: vec![0, 0xff],
                markers: 1,
                crc: CrcRecord::Good { field: 0xdeadbeef },
                segment: Ok(segment),
            }),
        };
        assert_eq!(
            to_json(&r),
            concat!(
                r#"{"frame":2,"first_frame":2,"connection":0,"src":"10.0.0.1:1","dst":"10.0.0.2:2","#,
                r#""stream_offset":0,"wire_len":40,"kind":"fpdu","ulpdu_len":28,"pad":"00ff","markers":1,"#,
                r#""crc":{"state":"good","field":"0xdeadbeef"},"segment":{"opcode":"Read Request","#,
                r#""last":true,"tagged":false,"qn":1,"msn":2,"mo":0,"read_request":{"sink_stag":"0x00000010","#,
                r#""sink_to":"0x0000000000000020","size":64,"src_stag":"0x00000030","#,
                r#""src_to":"0x0000000000000040"},"invalidate_stag":"0x000000ab","terminate":{"layer":1,"#,
                r#""etype":2,"code":3,"m":true,"d":false,"r":true,"reserved":0,"layout":"linux_siw","#,
                r#""description":"x"},"payload_len":28}}"#
            )
        );
        if let Item::Fpdu(p) = &mut r.item {
            p.segment = Err("short".into());
            p.crc = CrcRecord::Off { field: 0 };
        }
        assert!(to_json(&r)
            .ends_with(r#""crc":{"state":"off","field":"0x00000000"},"segment_error":"short"}"#));
        r.item = Item::MpaFrame(MpaFrameRecord {
            request: true,
            revision: 1,
            markers: true,
            crc: false,
            reject: false,
            res: 0,
            private_data: vec![],
            enhanced: None,
        });
        assert!(to_json(&r).ends_with(
            r#""kind":"mpa_request","revision":1,"markers":true,"crc":false,"reject":false,"res":0,"private_data":""}"#
        ));
    }
}
