//! Wall-clock timestamps for records, resources and log lines: milliseconds or nanoseconds
//! since the Unix epoch, and RFC 3339 text in UTC (`2024-05-01T12:34:56.789Z`), formatted by
//! hand so the crate needs no date library. Pure functions apart from reading the clock.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch (0 if the clock is before 1970).
pub fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn unix_ms(t: SystemTime) -> u64 {
    unix_ns(t) / 1_000_000
}

/// Now, in nanoseconds since the Unix epoch.
pub fn now_unix_ns() -> u64 {
    unix_ns(SystemTime::now())
}

/// Now, in milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// RFC 3339 UTC text with milliseconds for a time given in nanoseconds since the epoch.
pub fn rfc3339_from_unix_ns(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let ms = (ns % 1_000_000_000) / 1_000_000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// RFC 3339 UTC text with milliseconds.
pub fn rfc3339(t: SystemTime) -> String {
    rfc3339_from_unix_ns(unix_ns(t))
}

/// Year, month (1-12) and day (1-31) of a count of days since 1970-01-01 (proleptic
/// Gregorian calendar; Howard Hinnant's `civil_from_days`, unsigned because times before
/// 1970 never occur here).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_formats_as_1970() {
        assert_eq!(rfc3339_from_unix_ns(0), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn known_instants_format_like_date_minus_u() {
        // date -u -d @951825600 → 2000-02-29 12:00:00 (a leap day of a year divisible by 400)
        assert_eq!(
            rfc3339_from_unix_ns(951_825_600_123_000_000),
            "2000-02-29T12:00:00.123Z"
        );
        // date -u -d @1709251199 → 2024-02-29 23:59:59
        assert_eq!(
            rfc3339_from_unix_ns(1_709_251_199_999_999_999),
            "2024-02-29T23:59:59.999Z"
        );
        // date -u -d @4102444800 → 2100-01-01 00:00:00 (2100 is not a leap year)
        assert_eq!(
            rfc3339_from_unix_ns(4_102_444_800_000_000_000),
            "2100-01-01T00:00:00.000Z"
        );
        assert_eq!(
            rfc3339_from_unix_ns(4_107_542_400_000_000_000),
            "2100-03-01T00:00:00.000Z"
        );
    }

    #[test]
    fn the_largest_time_does_not_panic() {
        let s = rfc3339_from_unix_ns(u64::MAX);
        assert!(s.ends_with('Z'));
    }
}
