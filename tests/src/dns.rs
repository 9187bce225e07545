//! A DNS server on a loopback UDP port that answers A and AAAA queries from a table the test
//! changes while it runs: the stand-in for a Kubernetes headless Service whose pods come and go.
//!
//! A name in the table gets its addresses of the asked type (none is an empty answer); a name
//! not in it gets NXDOMAIN. Answers have a TTL of 0, so nothing is cached on the way.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, Record, RecordType};
use parking_lot::Mutex;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// Names (lower case, no trailing dot) and their addresses.
type Table = Arc<Mutex<HashMap<String, Vec<IpAddr>>>>;

/// The running server; it stops when dropped.
#[derive(Debug)]
pub struct DnsServer {
    /// Where it listens (UDP).
    pub address: SocketAddr,
    table: Table,
    answered: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl DnsServer {
    /// Starts a server on a free port of 127.0.0.1 with an empty table.
    pub async fn start() -> anyhow::Result<Self> {
        let socket = UdpSocket::bind("127.0.0.1:0").await?;
        let address = socket.local_addr()?;
        let table = Table::default();
        let answered = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(serve(socket, table.clone(), answered.clone()));
        Ok(Self {
            address,
            table,
            answered,
            task,
        })
    }

    /// Queries answered so far (each from the table as it was when answered).
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Makes `name` resolve to `addresses` (an empty list answers no records).
    pub fn set(&self, name: &str, addresses: &[IpAddr]) {
        self.table.lock().insert(key(name), addresses.to_vec());
    }

    /// Makes `name` unknown (NXDOMAIN).
    pub fn remove(&self, name: &str) {
        self.table.lock().remove(&key(name));
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

async fn serve(socket: UdpSocket, table: Table, answered: Arc<AtomicU64>) {
    let mut buf = vec![0; 4096];
    loop {
        let Ok((len, from)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        let Ok(request) = Message::from_vec(&buf[..len]) else {
            continue;
        };
        if request.metadata.message_type != MessageType::Query {
            continue;
        }
        let Ok(bytes) = answer(&request, &table).to_vec() else {
            continue;
        };
        if socket.send_to(&bytes, from).await.is_ok() {
            answered.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The answer to `request`: every query's records from the table.
fn answer(request: &Message, table: &Table) -> Message {
    let mut response = Message::response(request.metadata.id, OpCode::Query);
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.metadata.authoritative = true;
    let table = table.lock();
    for query in &request.queries {
        response.add_query(query.clone());
        let Some(addresses) = table.get(&key(&query.name().to_string())) else {
            response.metadata.response_code = ResponseCode::NXDomain;
            continue;
        };
        for &ip in addresses {
            let wanted = match ip {
                IpAddr::V4(_) => RecordType::A,
                IpAddr::V6(_) => RecordType::AAAA,
            };
            if query.query_type() == wanted {
                response.add_answer(Record::from_rdata(query.name().clone(), 0, RData::from(ip)));
            }
        }
    }
    response
}
