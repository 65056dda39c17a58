//! Human-friendly sizes (`4k`, `1M`, `1GiB`) and durations (`10s`, `250ms`).
//!
//! Sizes: an unsigned integer with an optional, case-insensitive suffix. All
//! suffixes are binary (powers of 1024), as in fio: `b`; `k`, `kb`, `kib`;
//! `m`, `mb`, `mib`; `g`, `gb`, `gib`; `t`, `tb`, `tib`. No fractions.
//!
//! Durations: a non-negative decimal number (fractions allowed) with a unit
//! `ns`, `us`, `ms`, `s`, `m` (minutes) or `h`; a bare number means seconds.

use std::time::Duration;

/// Why a size or duration did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseUnitError(pub String);

fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    (&s[..end], s[end..].trim())
}

/// Parse a size such as `4096`, `4k`, `1M`, `1GiB`.
pub fn parse_size(input: &str) -> Result<u64, ParseUnitError> {
    let s = input.trim();
    let (num, unit) = split_number(s);
    let num = num.replace('_', "");
    if num.is_empty() || num.contains('.') {
        return Err(ParseUnitError(format!(
            "invalid size {input:?}: expected an integer with an optional unit (e.g. 4k, 1M, 1GiB)"
        )));
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(ParseUnitError(format!(
                "invalid size {input:?}: unknown unit {unit:?} (use k, M, G or T; all are powers of 1024)"
            )))
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| ParseUnitError(format!("invalid size {input:?}: number too large")))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| ParseUnitError(format!("invalid size {input:?}: too large")))
}

/// Format a byte count with the largest exact binary unit (`4k`, `1M`, `1536`).
pub fn format_size(n: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "k")] {
        if n != 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{}", n >> shift, suffix);
        }
    }
    n.to_string()
}

/// Parse a duration such as `10s`, `250ms`, `1.5s`, `2m`, `1h`, `30` (seconds).
pub fn parse_duration(input: &str) -> Result<Duration, ParseUnitError> {
    let s = input.trim();
    let (num, unit) = split_number(s);
    let num = num.replace('_', "");
    let bad = || {
        ParseUnitError(format!(
            "invalid duration {input:?}: expected a number with a unit (ns, us, ms, s, m, h), e.g. 10s"
        ))
    };
    if num.is_empty() || num.starts_with('.') || num.matches('.').count() > 1 {
        return Err(bad());
    }
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "" | "s" | "sec" | "secs" => 1.0,
        "m" | "min" | "mins" => 60.0,
        "h" | "hr" | "hours" => 3600.0,
        _ => return Err(bad()),
    };
    // Integers are converted exactly; fractions go through f64.
    if !num.contains('.') {
        let n: u64 = num.parse().map_err(|_| bad())?;
        let d = match unit.to_ascii_lowercase().as_str() {
            "ns" => Some(Duration::from_nanos(n)),
            "us" | "µs" => Some(Duration::from_micros(n)),
            "ms" => Some(Duration::from_millis(n)),
            "" | "s" | "sec" | "secs" => Some(Duration::from_secs(n)),
            "m" | "min" | "mins" => n.checked_mul(60).map(Duration::from_secs),
            _ => n.checked_mul(3600).map(Duration::from_secs),
        };
        return d.ok_or_else(|| ParseUnitError(format!("invalid duration {input:?}: too large")));
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    Duration::try_from_secs_f64(v * scale)
        .map_err(|_| ParseUnitError(format!("invalid duration {input:?}: out of range")))
}

/// Format a duration compactly (`10s`, `250ms`, `1.5s`).
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.as_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("4kb").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("3T").unwrap(), 3 << 40);
        assert_eq!(parse_size(" 512b ").unwrap(), 512);
        assert_eq!(parse_size("1_000").unwrap(), 1000);
    }

    #[test]
    fn bad_sizes() {
        for s in [
            "",
            "k",
            "1.5M",
            "-1",
            "4x",
            "4 kk",
            "1e3",
            "99999999999999999999",
        ] {
            assert!(parse_size(s).is_err(), "{s:?} should not parse");
        }
        assert!(parse_size("16777216T").is_err(), "overflow");
        let e = parse_size("4x").unwrap_err().to_string();
        assert!(e.contains("unknown unit"), "{e}");
    }

    #[test]
    fn size_format_round_trip() {
        for n in [0, 1, 1000, 4096, 1 << 20, 3 << 30, 5 << 40, 1536] {
            assert_eq!(parse_size(&format_size(n)).unwrap(), n);
        }
        assert_eq!(format_size(4096), "4k");
        assert_eq!(format_size(1536), "1536");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("5us").unwrap(), Duration::from_micros(5));
        assert_eq!(parse_duration("7ns").unwrap(), Duration::from_nanos(7));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0.25m").unwrap(), Duration::from_secs(15));
    }

    #[test]
    fn bad_durations() {
        for s in ["", "s", "-1s", "10x", "1.2.3s", ".5s", "1e9s"] {
            assert!(parse_duration(s).is_err(), "{s:?} should not parse");
        }
    }

    #[test]
    fn duration_format_round_trip() {
        for d in [
            Duration::from_secs(10),
            Duration::from_millis(250),
            Duration::from_micros(7),
        ] {
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
    }
}
