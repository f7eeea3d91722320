//! The front door's settings (`server.header_timeout`, `body_timeout`, `send_timeout`,
//! `idle_timeout`, `max_connections`): plain data the config builds, so the config needs
//! nothing else of the front door.

use std::time::Duration;

/// `server.header_timeout`, `body_timeout`, `send_timeout`, `idle_timeout` and
/// `max_connections`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// The whole request head must arrive within this (from accept, or from its first byte on
    /// a kept-alive connection).
    pub header_timeout: Duration,
    /// Longest gap between two reads of a request body (→ 408).
    pub body_timeout: Duration,
    /// Longest gap between two writes to a client that doesn't read (→ connection closed).
    pub send_timeout: Duration,
    /// A client connection with no request in progress is closed after this: an HTTP/1
    /// connection between two requests (from the end of one response to the first byte of the
    /// next head), an HTTP/2 connection without an open stream.
    pub idle_timeout: Duration,
    /// Open client connections per instance; more are refused at once.
    pub max_connections: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 10_000,
        }
    }
}
