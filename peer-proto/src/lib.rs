//! The rack peer protocol, without storage: what a request for a run of blocks says
//! ([`wire`]), how requests and the blocks sent back are authenticated with the cluster key
//! ([`auth`]), which member owns a run ([`owner`]), the asker's HTTP/1.1 client ([`client`])
//! and the owner's checks and framing ([`server`]), and optional TLS for the links ([`tls`]). The daemon's listener serves with these
//! pieces; see the README's "Rack peers" for the threat model.

pub mod auth;
pub mod client;
pub mod owner;
pub mod server;
pub mod tls;
pub mod wire;
