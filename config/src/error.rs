//! The one error type of this crate.
//!
//! Every variant says where the problem is: the file path, the TOML
//! location (toml's own message shows the offending line and key), or the
//! configuration key / command-line flag together with the rejected value.

use std::io;
use std::path::{Path, PathBuf};

/// Why a configuration could not be loaded or is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The configuration file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file that was being read.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: io::Error,
    },

    /// The TOML text is malformed, has an unknown key, or holds a value of
    /// the wrong type or form. `message` is toml's own report, which quotes
    /// the offending line.
    #[error("cannot parse config{}: {message}", location(path.as_deref(), key.as_deref()))]
    Parse {
        /// The file the text came from, if any.
        path: Option<PathBuf>,
        /// The dotted key at fault (`cache.block_size`), when it could be
        /// worked out from the error's position.
        key: Option<String>,
        /// toml's description of the problem.
        message: String,
    },

    /// A setting has an unacceptable value.
    ///
    /// `key` names the setting where its value came from: the dotted config
    /// key (`cache.block_size`, `source[1].name`) for the file, the flag
    /// (`--block-size`) for the command line, the variable
    /// (`LARDER_BLOCK_SIZE`) for the environment.
    #[error("invalid {key} = {value:?}: {reason}")]
    Invalid {
        /// Which setting.
        key: String,
        /// The rejected value, as text.
        value: String,
        /// Why it was rejected and what would be accepted.
        reason: String,
    },

    /// No `[[source]]` was configured, neither in the file nor with `--source`.
    #[error("no sources configured: at least one [[source]] is required (or pass --source NAME=URL)")]
    NoSources,

    /// The configuration could not be written out as TOML.
    #[error("cannot render config as TOML: {message}")]
    Render {
        /// toml's description of the problem.
        message: String,
    },
}

impl ConfigError {
    /// Renames the key of an [`ConfigError::Invalid`] through `names` (config key → the flag
    /// or variable its value came from), and shows its value as `typed` has it (config key →
    /// all that was typed for that flag or variable, e.g. `NAME=URL`); other errors and
    /// unlisted keys are left as they are.
    pub(crate) fn named_by(
        self,
        names: &std::collections::HashMap<String, String>,
        typed: &std::collections::HashMap<String, String>,
    ) -> Self {
        match self {
            Self::Invalid { key, value, reason } => Self::Invalid {
                value: typed.get(&key).cloned().unwrap_or(value),
                key: names.get(&key).cloned().unwrap_or(key),
                reason,
            },
            other => other,
        }
    }
}

/// " file PATH at KEY", leaving out the parts that are unknown.
fn location(path: Option<&Path>, key: Option<&str>) -> String {
    let mut text = String::new();
    if let Some(path) = path {
        text.push_str(&format!(" file {}", path.display()));
    }
    if let Some(key) = key {
        text.push_str(&format!(" at {key}"));
    }
    text
}

impl ConfigError {
    /// Builds an [`ConfigError::Invalid`].
    pub(crate) fn invalid(key: impl Into<String>, value: impl ToString, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_key_and_quotes_value() {
        let err = ConfigError::invalid(
            "cache.block_size",
            "3MiB",
            "must be a power of two between 1MiB and 64MiB",
        );
        assert_eq!(
            err.to_string(),
            "invalid cache.block_size = \"3MiB\": must be a power of two between 1MiB and 64MiB"
        );
    }

    #[test]
    fn parse_and_read_name_the_file() {
        let err = ConfigError::Parse {
            path: Some("/etc/larder.toml".into()),
            key: Some("cache.dir".into()),
            message: "boom".into(),
        };
        assert_eq!(
            err.to_string(),
            "cannot parse config file /etc/larder.toml at cache.dir: boom"
        );
        let err = ConfigError::Parse {
            path: None,
            key: None,
            message: "boom".into(),
        };
        assert_eq!(err.to_string(), "cannot parse config: boom");
        let err = ConfigError::Read {
            path: "/nope.toml".into(),
            source: io::Error::new(io::ErrorKind::NotFound, "gone"),
        };
        assert_eq!(err.to_string(), "cannot read config file /nope.toml: gone");
    }
}
