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
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => {
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
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(ConfDuration)
            .map_err(serde::de::Error::custom)
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
}
