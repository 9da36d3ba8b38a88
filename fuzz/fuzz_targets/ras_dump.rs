//! Component dumps (`softwarp_ras::dump`), input from files and TCP collectors: parsing
//! arbitrary bytes never panics; a dump built from the input's bytes parses back whole with
//! the same sections; every proper prefix of it is reported incomplete.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softwarp_ras::dump::{parse, DumpWriter};

fuzz_target!(|data: &[u8]| {
    // Whatever the bytes, a typed result.
    if let Ok(d) = parse(data) {
        let _ = d.is_complete();
        for s in &d.sections {
            let _ = (s.name(), s.to_json());
        }
    }
    // A dump of the input, cut into sections at every 0xff byte (bodies as JSON strings).
    let mut w = DumpWriter::new();
    let bodies: Vec<String> = data
        .split(|&b| b == 0xff)
        .take(32)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        w.section(&format!("part-{i}"), body).expect("a valid name");
    }
    let dump = w.finish();
    let d = parse(&dump).expect("our own dump is a dump");
    assert!(d.is_complete(), "{:?}", d.error);
    assert_eq!(d.sections.len(), bodies.len());
    for (s, body) in d.sections.iter().zip(&bodies) {
        assert_eq!(s.to_json(), serde_json::Value::String(body.clone()));
    }
    // A cut at a place the input chooses is never taken for a whole dump.
    let cut = data.first().map_or(0, |&b| b as usize * dump.len() / 256);
    if cut < dump.len() {
        if let Ok(d) = parse(&dump[..cut]) {
            assert!(!d.is_complete(), "a prefix of {cut} of {} bytes", dump.len());
        }
    }
});
