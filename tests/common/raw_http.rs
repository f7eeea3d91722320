//! HTTP/1.1 by hand on a raw socket, for requests no HTTP client library would send.

use std::io::Read;
use std::time::Duration;

/// A response read off a raw socket (for requests no HTTP client library would send).
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for RawResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &String::from_utf8_lossy(&self.body))
            .finish()
    }
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// Whether this is a problem JSON whose `type` ends in `kind`.
    pub fn is_problem(&self, kind: &str) -> bool {
        self.header("content-type") == Some("application/problem+json")
            && self.json()["type"]
                .as_str()
                .is_some_and(|t| t.ends_with(kind))
    }
}

/// A request head with `Host`, the given extra header lines and `Connection: close`.
pub fn raw(request_line: &str, headers: &[&str]) -> Vec<u8> {
    let mut s = format!("{request_line} HTTP/1.1\r\nHost: localhost\r\n");
    for h in headers {
        s.push_str(h);
        s.push_str("\r\n");
    }
    s.push_str("Connection: close\r\n\r\n");
    s.into_bytes()
}

/// Connects to the gateway's proxy port, with a read timeout so that a test never hangs.
pub fn raw_connect(port: u16) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Sends `request` byte for byte on a new connection and reads one response. `None` when the
/// server closed the connection without answering.
pub fn raw_request(port: u16, request: &[u8]) -> Option<RawResponse> {
    use std::io::Write;
    let mut s = raw_connect(port);
    s.write_all(request).unwrap();
    read_raw_response(&mut s)
}

/// Reads an interim (1xx) response's head, byte by byte so that nothing after it is taken:
/// its status. `None` when the connection closed first.
pub fn read_interim(s: &mut std::net::TcpStream) -> Option<u16> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    String::from_utf8_lossy(&head)
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}

/// Reads one HTTP/1.1 response (Content-Length, chunked, or until close).
pub fn read_raw_response(s: &mut std::net::TcpStream) -> Option<RawResponse> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = buf[head_end + 4..].to_vec();
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut read_more = |body: &mut Vec<u8>| match s.read(&mut chunk) {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            body.extend_from_slice(&chunk[..n]);
            true
        }
    };
    if let Some(len) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len && read_more(&mut body) {}
        body.truncate(len);
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        while !body.windows(5).any(|w| w == b"0\r\n\r\n") && read_more(&mut body) {}
        body = dechunk(&body);
    } else {
        while read_more(&mut body) {}
    }
    Some(RawResponse {
        status,
        headers,
        body,
    })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..i])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok())
            .unwrap_or(0);
        b = &b[i + 2..];
        if size == 0 || b.len() < size {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or_default();
    }
    out
}

/// Whether the server closes `s` (EOF or reset) within `within`: bytes it still sends are
/// read and skipped. (A close that follows an answer arrives a moment after it: a check
/// without waiting saw it open on a loaded machine.)
pub fn closes_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if is_closed(s) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    is_closed(s)
}

/// Whether the server has closed `s` (EOF or reset) — without waiting: bytes already sent to
/// us (a 408, say) are read and skipped.
pub fn is_closed(s: &mut std::net::TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut chunk = [0u8; 4096];
    let closed = loop {
        match s.read(&mut chunk) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    s.set_nonblocking(false).unwrap();
    closed
}
