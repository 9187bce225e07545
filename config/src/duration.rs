//! Durations written as humantime strings (`"30s"`, `"250ms"`, `"5m"`).
//!
//! The same [`parse`] function serves the TOML file (through the serde
//! helpers in [`humantime_serde`]) and the command line, so a bad value gets
//! the same explanation wherever it came from.

use std::time::Duration;

/// Parses a humantime duration such as `"3s"`, `"250ms"` or `"1m 30s"`.
///
/// The error message quotes the text and says what humantime disliked.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|err| {
        format!("invalid duration {text:?}: {err} (expected e.g. \"250ms\", \"30s\" or \"5m\")")
    })
}

/// Serde `with` helpers storing a [`Duration`] as a humantime string.
pub(crate) mod humantime_serde {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    /// Writes the duration as humantime text, e.g. `"1m 30s"`.
    pub(crate) fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(*value))
    }

    /// Reads a duration from humantime text.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_str(DurationVisitor)
    }

    /// Accepts only strings: a bare number would leave the unit to guesswork.
    struct DurationVisitor;

    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration string such as \"250ms\", \"30s\" or \"5m\"")
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
            super::parse(text).map_err(E::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_humantime_text() {
        assert_eq!(parse("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse(" 5m ").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("1m 30s").unwrap(), Duration::from_secs(90));
    }

    #[test]
    fn errors_quote_the_text() {
        for bad in ["soon", "10", "", "-3s"] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn serde_round_trip_and_rejects_integers() {
        #[derive(Debug, PartialEq, serde::Deserialize, serde::Serialize)]
        struct Wrapper {
            #[serde(with = "humantime_serde")]
            timeout: Duration,
        }
        let w = Wrapper {
            timeout: Duration::from_millis(1500),
        };
        let text = toml::to_string(&w).unwrap();
        assert_eq!(text, "timeout = \"1s 500ms\"\n");
        assert_eq!(toml::from_str::<Wrapper>(&text).unwrap(), w);
        let err = toml::from_str::<Wrapper>("timeout = 10").unwrap_err();
        assert!(err.to_string().contains("duration string"), "{err}");
    }
}
