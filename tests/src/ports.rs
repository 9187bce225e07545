//! Ports for the servers a test starts. The kernel may hand the same free port to two binds
//! in a row once the first is closed, so a test that asks twice (a daemon's metrics and its
//! registry, say) could give one daemon the same port for two listeners. [`free_port`] never
//! gives the same port twice in one test process; the tests of a binary share that process.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::{Mutex, PoisonError};

/// Every port given out so far in this process, on any address.
static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port free on `ip` when asked (nothing holds it afterwards), not given out before by this
/// process.
pub fn free_port(ip: Ipv4Addr) -> anyhow::Result<u16> {
    let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
    for _ in 0..100 {
        let port = TcpListener::bind(SocketAddr::from((ip, 0)))?.local_addr()?.port();
        if given.insert(port) {
            return Ok(port);
        }
    }
    anyhow::bail!("the kernel gave only ports already given out on {ip}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_port_is_given_twice() {
        let mut seen = BTreeSet::new();
        for _ in 0..1000 {
            let port = free_port(Ipv4Addr::LOCALHOST).expect("port");
            assert!(seen.insert(port), "port {port} given twice");
        }
    }
}
