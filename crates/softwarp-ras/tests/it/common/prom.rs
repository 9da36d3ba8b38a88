//! A small, strict parser of the Prometheus text exposition format (version 0.0.4), to check
//! what `StatsSnapshot::to_prometheus` writes: HELP/TYPE lines before their samples, at most
//! one of each per metric, valid metric and label names, escapes only where allowed, values
//! that parse as floats (including NaN, +Inf, -Inf).

#![allow(dead_code)]

use std::collections::BTreeMap;

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Family {
    pub help: Option<String>,
    pub kind: Option<String>,
    pub samples: Vec<(BTreeMap<String, String>, f64)>,
}

fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn unescape_help(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('\\') => out.push('\\'),
                Some('n') => out.push('\n'),
                other => return Err(format!("bad escape in HELP: \\{other:?}")),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "NaN" => Ok(f64::NAN),
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        _ => s
            .parse::<f64>()
            .map_err(|e| format!("bad value {s:?}: {e}")),
    }
}

/// Parses `{a="x",b="y"}` at the start of `s`; returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("expected {")?;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let name = &rest[..eq];
        if !valid_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value without quote")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape in label value: {other:?}")),
                },
                Some((_, '\n')) => return Err("raw newline in label value".into()),
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err("expected , or } after a label".into());
        }
    }
}

/// Parses a whole exposition; every problem is an error naming the line.
pub fn parse(text: &str) -> Result<BTreeMap<String, Family>, String> {
    let mut fams: BTreeMap<String, Family> = BTreeMap::new();
    let mut seen_samples: Vec<String> = Vec::new();
    if !text.is_empty() && !text.ends_with('\n') {
        return Err("the exposition must end with a newline".into());
    }
    // Lines end with \n only (a \r is text).
    let body = text.strip_suffix('\n').unwrap_or(text);
    for (no, line) in body.split('\n').enumerate() {
        if text.is_empty() {
            break;
        }
        let err = |m: String| format!("line {}: {m}: {line:?}", no + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let keyword = parts.next().unwrap_or("");
            if keyword != "HELP" && keyword != "TYPE" {
                continue; // a plain comment
            }
            let name = parts.next().ok_or_else(|| err("no metric name".into()))?;
            if !valid_metric_name(name) {
                return Err(err(format!("bad metric name {name:?}")));
            }
            if seen_samples.iter().any(|s| s == name) {
                return Err(err(format!("{keyword} after samples of {name}")));
            }
            let fam = fams.entry(name.to_string()).or_default();
            let arg = parts.next().unwrap_or("");
            if keyword == "HELP" {
                if fam.help.is_some() {
                    return Err(err("second HELP".into()));
                }
                fam.help = Some(unescape_help(arg).map_err(err)?);
            } else {
                if fam.kind.is_some() {
                    return Err(err("second TYPE".into()));
                }
                if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&arg) {
                    return Err(err(format!("bad type {arg:?}")));
                }
                fam.kind = Some(arg.to_string());
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| err("no value".into()))?;
        let name = &line[..name_end];
        if !valid_metric_name(name) {
            return Err(err(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(err)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let rest = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("no space before value".into()))?;
        let mut fields = rest.split(' ');
        let value = parse_value(fields.next().unwrap_or("")).map_err(err)?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>()
                .map_err(|e| err(format!("bad timestamp: {e}")))?;
        }
        if fields.next().is_some() {
            return Err(err("trailing text".into()));
        }
        if seen_samples.last().map(String::as_str) != Some(name) {
            if seen_samples.iter().any(|s| s == name) {
                return Err(err(format!("samples of {name} are not grouped together")));
            }
            seen_samples.push(name.to_string());
        }
        fams.entry(name.to_string())
            .or_default()
            .samples
            .push((labels, value));
    }
    Ok(fams)
}
