//! The `larder` daemon: the binary's library, which wires the layer crates together.
//!
//! Start reading at [`daemon::run`]: it opens the block store (`larder-store`), builds the
//! origins (`larder-origin`) and the read path over them (`larder-read-path`), adds the rack
//! peers (`larder-peers`) and the registry mirror (`larder-registry`) when configured, and
//! serves the [`namespace`] through the FUSE mount, the control socket ([`control`]) and
//! [`metrics`]. The jobs ([`prefetch`], [`seal`]) and the command line ([`cli`]) live here too.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod cli;
pub mod containerd;
pub mod control;
pub mod daemon;
pub mod fs_error;
pub mod kube;
pub mod metrics;
pub mod namespace;
pub mod prefetch;
pub mod process;
pub mod seal;
pub mod warm;
