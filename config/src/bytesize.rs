//! Byte quantities written the way people write them.
//!
//! [`ByteSize`] holds an exact number of bytes. It parses text such as
//! `"500GiB"`, `"4 MiB"`, `"1.5GiB"`, `"100GB"` or `"1024"`, and prints itself
//! in the largest binary unit that divides it exactly (`4MiB`, `1536KiB`,
//! `7B`), so that a printed value always reads back to the same number.
//!
//! Units are case-insensitive. `K`, `KiB`, `M`, `MiB`, ... are powers of 1024;
//! `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` (or no unit) is plain bytes.
//! A fractional number is accepted only when it comes to a whole number of
//! bytes (`1.5KiB` is fine, `1.5B` is not).

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Binary units used for display, largest first.
const DISPLAY_UNITS: [(u64, &str); 4] = [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")];

/// The units understood by the parser, as written in error messages.
const UNIT_LIST: &str = "B, K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)";

/// An exact number of bytes, read from and written as human-friendly text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` kibibytes (`n * 1024` bytes). Saturates instead of overflowing.
    pub const fn kib(n: u64) -> Self {
        Self(n.saturating_mul(KIB))
    }

    /// `n` mebibytes (`n * 1024^2` bytes). Saturates instead of overflowing.
    pub const fn mib(n: u64) -> Self {
        Self(n.saturating_mul(MIB))
    }

    /// `n` gibibytes (`n * 1024^3` bytes). Saturates instead of overflowing.
    pub const fn gib(n: u64) -> Self {
        Self(n.saturating_mul(GIB))
    }

    /// The number of bytes.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        if bytes != 0 {
            for (unit, name) in DISPLAY_UNITS {
                if bytes.is_multiple_of(unit) {
                    return write!(f, "{}{name}", bytes / unit);
                }
            }
        }
        write!(f, "{bytes}B")
    }
}

/// Why a piece of text is not a byte size. The message quotes the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid byte size {text:?}: {reason}")]
pub struct ParseByteSizeError {
    /// The text that was rejected, as given.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ParseByteSizeError {
    fn new(text: &str, reason: impl Into<String>) -> Self {
        Self {
            text: text.to_owned(),
            reason: reason.into(),
        }
    }
}

/// The multiplier for a unit suffix, or `None` if the unit is unknown.
fn unit_multiplier(unit: &str) -> Option<u64> {
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => GIB,
        "t" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    Some(multiplier)
}

impl FromStr for ByteSize {
    type Err = ParseByteSizeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(ParseByteSizeError::new(
                text,
                "empty; expected a number with an optional unit",
            ));
        }
        if trimmed.starts_with('-') {
            return Err(ParseByteSizeError::new(text, "sizes cannot be negative"));
        }
        let number_end = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(number_end);
        let unit = unit.trim_start();
        if number.is_empty() {
            return Err(ParseByteSizeError::new(
                text,
                "expected a number, optionally followed by a unit",
            ));
        }
        let multiplier = unit_multiplier(unit).ok_or_else(|| {
            ParseByteSizeError::new(
                text,
                format!("unknown unit {unit:?}; expected one of {UNIT_LIST}"),
            )
        })?;

        let (whole, fraction) = match number.split_once('.') {
            Some((whole, fraction)) => (whole, fraction),
            None => (number, ""),
        };
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(ParseByteSizeError::new(
                text,
                format!("{number:?} is not a number"),
            ));
        }
        // Work in u128 with the decimal point removed: value = mantissa / 10^scale.
        let too_large = || ParseByteSizeError::new(text, "too large; the maximum is 2^64 - 1 bytes");
        let digits = format!("{whole}{fraction}");
        let significant = digits.trim_start_matches('0');
        let mantissa: u128 = if significant.is_empty() {
            0
        } else if significant.len() > 30 {
            return Err(too_large());
        } else {
            significant
                .parse()
                .map_err(|_| ParseByteSizeError::new(text, format!("{number:?} is not a number")))?
        };
        let scale = 10u128.pow(u32::try_from(fraction.len()).map_err(|_| too_large())?);
        let scaled = mantissa
            .checked_mul(u128::from(multiplier))
            .ok_or_else(too_large)?;
        if !scaled.is_multiple_of(scale) {
            return Err(ParseByteSizeError::new(
                text,
                "does not come to a whole number of bytes",
            ));
        }
        u64::try_from(scaled / scale)
            .map(ByteSize)
            .map_err(|_| too_large())
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ByteSizeVisitor)
    }
}

/// Accepts a string in any of the forms [`ByteSize::from_str`] takes, or a
/// non-negative integer meaning bytes.
struct ByteSizeVisitor;

impl Visitor<'_> for ByteSizeVisitor {
    type Value = ByteSize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte size such as \"4MiB\" or \"100GB\", or an integer number of bytes")
    }

    fn visit_u64<E: de::Error>(self, bytes: u64) -> Result<ByteSize, E> {
        Ok(ByteSize(bytes))
    }

    fn visit_i64<E: de::Error>(self, bytes: i64) -> Result<ByteSize, E> {
        u64::try_from(bytes)
            .map(ByteSize)
            .map_err(|_| E::custom(format!("invalid byte size {bytes}: sizes cannot be negative")))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<ByteSize, E> {
        text.parse().map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<u64, ParseByteSizeError> {
        text.parse::<ByteSize>().map(ByteSize::as_u64)
    }

    #[test]
    fn parses_binary_decimal_and_bare_forms() {
        assert_eq!(parse("500GiB").unwrap(), 500 * GIB);
        assert_eq!(parse("4 MiB").unwrap(), 4 * MIB);
        assert_eq!(parse("1.5GiB").unwrap(), 3 * GIB / 2);
        assert_eq!(parse("512KiB").unwrap(), 512 * KIB);
        assert_eq!(parse("100GB").unwrap(), 100_000_000_000);
        assert_eq!(parse("1024").unwrap(), 1024);
        assert_eq!(parse("7b").unwrap(), 7);
        assert_eq!(parse("2k").unwrap(), 2048);
        assert_eq!(parse("3kb").unwrap(), 3000);
        assert_eq!(parse("1T").unwrap(), TIB);
        assert_eq!(parse("2tb").unwrap(), 2_000_000_000_000);
        assert_eq!(parse("  8 mib ").unwrap(), 8 * MIB);
        assert_eq!(parse("0").unwrap(), 0);
        assert_eq!(parse(".5KiB").unwrap(), 512);
        assert_eq!(parse("18446744073709551615").unwrap(), u64::MAX);
    }

    #[test]
    fn rejects_bad_text_and_quotes_it() {
        for bad in [
            "4 MB/s", "lots", "-1GiB", "", "1.5B", "0.1KiB", "1..2MiB", ".", "16EiB", "MiB",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        assert!(parse("-1GiB").unwrap_err().reason.contains("negative"));
        assert!(
            parse("4 MB/s")
                .unwrap_err()
                .reason
                .contains("unknown unit \"MB/s\"")
        );
    }

    #[test]
    fn rejects_overflow() {
        for big in [
            "18446744073709551616",
            "16777216TiB",
            "20000000TB",
            "99999999999999999999999999999999999",
        ] {
            assert!(parse(big).is_err(), "{big}");
        }
    }

    #[test]
    fn displays_largest_exact_binary_unit() {
        assert_eq!(ByteSize::mib(4).to_string(), "4MiB");
        assert_eq!(ByteSize::gib(100).to_string(), "100GiB");
        assert_eq!(ByteSize(1536 * KIB).to_string(), "1536KiB");
        assert_eq!(ByteSize(1_000_000).to_string(), "1000000B");
        assert_eq!(ByteSize(0).to_string(), "0B");
        assert_eq!(ByteSize(TIB * 3).to_string(), "3TiB");
        for value in [0, 1, 1000, 4096, 3 * GIB / 2, u64::MAX] {
            assert_eq!(parse(&ByteSize(value).to_string()).unwrap(), value);
        }
    }

    #[test]
    fn serde_accepts_strings_and_integers() {
        #[derive(Deserialize, Serialize)]
        struct Wrapper {
            size: ByteSize,
        }
        let w: Wrapper = toml::from_str("size = \"4MiB\"").unwrap();
        assert_eq!(w.size, ByteSize::mib(4));
        let w: Wrapper = toml::from_str("size = 4096").unwrap();
        assert_eq!(w.size, ByteSize::kib(4));
        let err = toml::from_str::<Wrapper>("size = -1").err().unwrap();
        assert!(err.to_string().contains("negative"), "{err}");
        let err = toml::from_str::<Wrapper>("size = \"lots\"").err().unwrap();
        assert!(err.to_string().contains("\"lots\""), "{err}");
        assert_eq!(
            toml::to_string(&Wrapper {
                size: ByteSize::mib(16)
            })
            .unwrap(),
            "size = \"16MiB\"\n"
        );
    }
}
