//! Byte sizes as gateway.yaml writes them: `512KiB`, `1MiB`, `16MiB` (or a plain number of
//! bytes). Binary units only: `1MB` is refused rather than guessed at.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size written in gateway.yaml, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfSize(pub u64);

/// Why a size string was refused; each quotes what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("expected a size like 512KiB, 1MiB or 16MiB, got \"{0}\"")]
    NotANumber(String),
    #[error("unknown size unit \"{unit}\" in \"{written}\" (use B, KiB, MiB or GiB)")]
    UnknownUnit { unit: String, written: String },
    #[error("size \"{0}\" is too large")]
    TooLarge(String),
}

pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| SizeError::NotANumber(s.into()))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        other => {
            return Err(SizeError::UnknownUnit {
                unit: other.into(),
                written: s.into(),
            })
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::TooLarge(s.into()))
}

pub fn format_size(n: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n > 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

impl<'de> Deserialize<'de> for ConfSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Size;
        impl serde::de::Visitor<'_> for Size {
            type Value = ConfSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size like 512KiB, 1MiB or 16MiB, or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ConfSize, E> {
                Ok(ConfSize(n))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ConfSize, E> {
                parse_size(s).map(ConfSize).map_err(E::custom)
            }
        }
        d.deserialize_any(Size)
    }
}

impl Serialize for ConfSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_size(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units_and_format_back() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("100"), Ok(100));
        assert_eq!(parse_size("2 GiB"), Ok(2 << 30));
        assert!(parse_size("1MB")
            .unwrap_err()
            .to_string()
            .contains("unknown size unit"));
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
        assert!(parse_size("18446744073709551615GiB")
            .unwrap_err()
            .to_string()
            .contains("too large"));
        assert_eq!(format_size(16 << 20), "16MiB");
        assert_eq!(format_size(1500), "1500B");
        assert_eq!(format_size(0), "0B");
    }
}
