//! Durations as gateway.yaml writes them: `250ms`, `10s`, `1m`, `1h`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

/// A duration written as a string in gateway.yaml.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConfDuration(pub Duration);

/// Why a duration string was refused; each quotes what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("expected a duration with a unit (ms, s, m, h), got \"{0}\"")]
    NoUnit(String),
    #[error("expected a duration like 250ms, 10s, 1m or 1h, got \"{0}\"")]
    NotANumber(String),
    #[error("unknown duration unit \"{unit}\" in \"{written}\" (use ms, s, m or h)")]
    UnknownUnit { unit: String, written: String },
    #[error("duration \"{0}\" is too long")]
    TooLong(String),
    #[error("a duration is a whole number of its unit: write \"{whole}\" for \"{written}\"")]
    Fraction { whole: String, written: String },
}

pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| DurationError::NoUnit(s.into()))?;
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| DurationError::NotANumber(s.into()))?;
    let ms = match unit_ms(unit) {
        Some(per) => n.checked_mul(per),
        None if unit.starts_with('.') => return Err(fraction(num, unit, s)),
        None => {
            return Err(DurationError::UnknownUnit {
                unit: unit.into(),
                written: s.into(),
            })
        }
    };
    // Ten years is far beyond any sensible window and keeps microsecond math far from overflow.
    match ms {
        Some(ms) if ms <= 10 * 365 * 24 * 3_600_000 => Ok(Duration::from_millis(ms)),
        _ => Err(DurationError::TooLong(s.into())),
    }
}

/// Milliseconds in one of a duration's units.
fn unit_ms(unit: &str) -> Option<u64> {
    match unit {
        "ms" => Some(1),
        "s" => Some(1_000),
        "m" => Some(60_000),
        "h" => Some(3_600_000),
        _ => None,
    }
}

/// `1.5s` (`num` "1", `rest` ".5s"): the same in whole milliseconds where it is one, else the
/// unknown-unit error it would have been.
fn fraction(num: &str, rest: &str, written: &str) -> DurationError {
    let digits = rest[1..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(rest.len(), |i| i + 1);
    let (frac, unit) = rest.split_at(digits);
    let value: Option<f64> = format!("{num}{frac}").parse().ok();
    match value.zip(unit_ms(unit)).map(|(v, per)| v * per as f64) {
        Some(ms) if ms.fract() == 0.0 && ms < 1e15 => DurationError::Fraction {
            whole: format_duration(Duration::from_millis(ms as u64)),
            written: written.into(),
        },
        _ => DurationError::UnknownUnit {
            unit: rest.into(),
            written: written.into(),
        },
    }
}

pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".into()
    } else if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1_000) {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    }
}

impl<'de> Deserialize<'de> for ConfDuration {
    /// Parsed in the visitor, so that a bad value's error carries the value's own line and
    /// column (serde_yaml places an error raised after the string was read at the start of
    /// the enclosing map).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = ConfDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration like 250ms, 10s, 1m or 1h")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ConfDuration, E> {
                parse_duration(s).map(ConfDuration).map_err(E::custom)
            }
        }
        d.deserialize_str(Text)
    }
}

impl Serialize for ConfDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("1d").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("99999999999999h").is_err());
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(120)), "2m");
    }

    /// A fraction says the whole form to write, where there is one.
    #[test]
    fn fractions_name_the_whole_form() {
        let e = |s: &str| parse_duration(s).unwrap_err().to_string();
        assert_eq!(
            e("1.5s"),
            "a duration is a whole number of its unit: write \"1500ms\" for \"1.5s\""
        );
        assert!(e("1.5h").contains("write \"90m\""), "{}", e("1.5h"));
        assert!(e("0.5m").contains("write \"30s\""), "{}", e("0.5m"));
        assert!(
            e("0.0001s").starts_with("unknown duration unit"),
            "{}",
            e("0.0001s")
        );
        assert!(
            e("1.5d").starts_with("unknown duration unit"),
            "{}",
            e("1.5d")
        );
    }
}
