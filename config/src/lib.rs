//! Larder's configuration.
//!
//! A [`Config`] comes from a TOML file, then `LARDER_*` environment
//! variables, then command-line flags, each overriding the one before
//! ([`ConfigArgs::load`]). Code that builds a `Config` by hand should call
//! [`Config::validate`] before using it.
//!
//! Sizes are [`ByteSize`] values written like `"4MiB"` or `"100GB"`;
//! durations are humantime strings like `"250ms"` or `"30s"`. Every error
//! ([`ConfigError`]) names the key or flag at fault and the rejected value.

mod args;
mod bytesize;
mod duration;
mod error;
mod redact;
mod schema;
mod validate;

pub use args::ConfigArgs;
pub use bytesize::{ByteSize, ParseByteSizeError};
pub use error::ConfigError;
pub use redact::{Redacted, SourceUrl, hide_credentials, hide_secret};
pub use schema::{
    CacheConfig, Config, ControlConfig, DEFAULT_CA_FILE, DEFAULT_CONTROL_SOCKET, DEFAULT_TOKEN_FILE,
    IoEngineKind, MetricsConfig, MountConfig, OriginConfig, PeerConfig, PeerMember, RegistryConfig,
    RegistryUpstream, SourceConfig, WarmConfig, is_peer_label,
};
