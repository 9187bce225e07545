//! One HTTP/1.1 request over a fresh connection, for fixtures that set up an emulator through an
//! API no client here speaks (Azure's container creation, fake-gcs-server's JSON uploads).

use std::io::{Read, Write};
use std::net::TcpStream;

use anyhow::Context;

/// Sends `method target` to `address` with `headers` (`Name: value` lines) and `body`, and
/// returns the answer's status code and body.
pub(crate) fn request(
    address: &str,
    method: &str,
    target: &str,
    headers: &[String],
    body: &[u8],
) -> anyhow::Result<(u16, String)> {
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for header in headers {
        head.push_str(header);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let mut stream = TcpStream::connect(address).with_context(|| format!("connecting to {address}"))?;
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let answer = String::from_utf8_lossy(&answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no HTTP status in {answer:?}"))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
