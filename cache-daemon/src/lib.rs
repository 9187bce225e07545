//! The `larder` daemon: the binary's library, which wires the layer crates together.
//!
//! Start reading at [`daemon::run`]: it builds the node's read side ([`node::Node`]: the block
//! store from `larder-store`, the origins from `larder-origin`, the rack peers from
//! `larder-peers` when configured, and the read path over them from `larder-read-path`; the
//! engine's tests build the same one), adds the registry mirror (`larder-registry`) and
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
pub mod node;
pub mod prefetch;
pub mod process;
pub mod scrub;
pub mod seal;
pub mod warm;
