//! Larder's daemon library: origins, the NVMe block store and the fill path.
//!
//! Start reading at [`cache`]: a read of a pinned [`object::ObjectVersion`] goes to the
//! [`store`] (NVMe), else to a single-flight fill from the [`origin`].

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod cache;
pub mod cli;
pub mod control;
pub mod control_api;
pub mod daemon;
pub mod engine;
pub mod fs_error;
pub mod http;
pub mod kube;
pub mod manifest;
pub mod members;
pub mod metrics;
pub mod namespace;
pub mod object;
pub mod origin;
pub mod peer;
pub mod prefetch;
pub mod published;
pub mod registry;
pub mod said;
pub mod seal;
pub mod stats;
pub mod store;
pub mod warm;
