//! The rack peer protocol, without storage or networking: what a request for a run of blocks
//! says ([`wire`]), how requests and the blocks sent back are authenticated with the cluster
//! key ([`auth`]), and which member owns a run ([`owner`]). The daemon serves and asks over
//! HTTP/1.1 with these pieces; see the README's "Rack peers" for the threat model.

pub mod auth;
pub mod owner;
pub mod wire;
