//! The proxy's listeners (`server.listen`, `server.tls.listen`), accepted by the gateway
//! itself instead of by Pingora's listening service. Pingora's service hands a connection to
//! the application only after its TLS handshake, which it allows 60 s: handshakes were neither
//! counted in `max_connections` nor bounded by `header_timeout` (issue 23, item 3). And its
//! accept loop, out of descriptors, retries every second with an ERROR each time. Here:
//!
//! - a connection counts from accept ([`OpenConnections`]), TLS or not; past
//!   `server.max_connections` it is closed at once;
//! - a TLS handshake must finish within `server.header_timeout`, else the connection is closed
//!   (counted as a `header` timeout);
//! - accept backs off while descriptors are exhausted ([`crate::accept`]).
//!
//! The connection then goes through the [`FrontDoor`] as before.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::listeners::tls::{Acceptor, TlsSettings};
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{GetSocketDigest, SocketDigest, Stream};
use pingora::proxy::ProxyHttp;
use pingora::server::{ListenFds, ShutdownWatch};
use tokio::net::{TcpListener, TcpStream};

use super::FrontDoor;
use crate::accept::{self, Backoff};
use crate::telemetry::{metrics, ClientTimeout, Listener};

/// Counts open client connections; a slot is held for a connection's lifetime.
#[derive(Debug, Default)]
pub(super) struct OpenConnections(AtomicUsize);

pub(super) struct OpenGuard<'a>(&'a OpenConnections);

impl OpenConnections {
    /// A slot, or `None` (counted as refused) when `max` connections are open.
    pub(super) fn try_open(&self, max: usize) -> Option<OpenGuard<'_>> {
        let n = self.0.fetch_add(1, Ordering::AcqRel) + 1;
        if n > max {
            self.0.fetch_sub(1, Ordering::AcqRel);
            metrics().connections_refused.inc();
            return None;
        }
        metrics().connections.inc();
        Some(OpenGuard(self))
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
        metrics().connections.dec();
    }
}

struct Endpoint {
    listener: std::net::TcpListener,
    tls: Option<TlsSettings>,
}

/// The Pingora service that runs the proxy's accept loops.
pub struct Listeners<SV> {
    door: Option<FrontDoor<SV>>,
    endpoints: Vec<Endpoint>,
}

impl<SV> Listeners<SV> {
    pub fn new(door: FrontDoor<SV>) -> Listeners<SV> {
        Listeners {
            door: Some(door),
            endpoints: Vec::new(),
        }
    }

    /// Serves plain HTTP on a bound listener (bound by the caller, so a clash fails at start).
    pub fn add_tcp(&mut self, listener: std::net::TcpListener) {
        self.endpoints.push(Endpoint {
            listener,
            tls: None,
        });
    }

    /// Serves TLS (HTTP/2 or HTTP/1.1 by ALPN) on a bound listener.
    pub fn add_tls(&mut self, listener: std::net::TcpListener, settings: TlsSettings) {
        self.endpoints.push(Endpoint {
            listener,
            tls: Some(settings),
        });
    }
}

#[async_trait]
impl<SV> pingora::services::Service for Listeners<SV>
where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        let Some(door) = self.door.take().map(Arc::new) else {
            return;
        };
        let mut loops = Vec::new();
        for e in self.endpoints.drain(..) {
            let listener = match e
                .listener
                .set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(e.listener))
            {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "cannot serve a listener");
                    continue;
                }
            };
            let tls = e.tls.map(|s| Arc::new(s.build()));
            let run = accept_loop(door.clone(), listener, tls, shutdown.clone());
            loops.push(pingora_runtime::current_handle().spawn(run));
        }
        for l in loops {
            let _ = l.await;
        }
        door.cleanup().await;
    }

    fn name(&self) -> &str {
        "tollgate"
    }
}

/// Accepts until shutdown; each connection runs on one of the service's worker threads.
async fn accept_loop<SV>(
    door: Arc<FrontDoor<SV>>,
    listener: TcpListener,
    tls: Option<Arc<Acceptor>>,
    mut shutdown: ShutdownWatch,
) where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    let mut backoff = Backoff::new(Listener::Proxy);
    loop {
        let (tcp, peer) = tokio::select! {
            c = accept::next(&listener, &mut backoff) => c,
            changed = shutdown.changed() => {
                // The watch's first value is not a shutdown.
                if changed.is_err() || *shutdown.borrow() {
                    return;
                }
                continue;
            }
        };
        let (door, tls, shutdown) = (door.clone(), tls.clone(), shutdown.clone());
        let accepted = std::time::Instant::now();
        pingora_runtime::current_handle().spawn(async move {
            let limits = door.shared.running().config.client_limits;
            // Counted from here, before any byte is read: a handshake is a connection too.
            let Some(_open) = door.open.try_open(limits.max_connections) else {
                // Dropping the socket closes it at once: the refusal costs no more than the accept.
                return;
            };
            // The handshake and the first request head, within header_timeout of accept.
            let within = limits.header_timeout;
            if let Some(stream) = handshake(tcp, peer, tls.as_deref(), within).await {
                door.serve(stream, accepted, &shutdown).await;
            }
        });
    }
}

/// The client stream as Pingora's layers expect it: the peer's address in its digest, TLS
/// terminated if the listener has it — within `within`, else `None` (the connection closes).
async fn handshake(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: Option<&Acceptor>,
    within: Duration,
) -> Option<Stream> {
    // As Pingora's own listener does: without it a response written in two parts (head, then
    // body) waits for the client's delayed ACK, 40 ms a request on Linux (Nagle).
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let digest = SocketDigest::from_raw_fd(tcp.as_raw_fd());
    let _ = digest.peer_addr.set(Some(peer.into()));
    let mut l4 = L4Stream::from(tcp);
    l4.set_socket_digest(digest);
    let Some(acceptor) = tls else {
        return Some(Box::new(l4));
    };
    match tokio::time::timeout(within, acceptor.tls_handshake(l4)).await {
        Ok(Ok(tls)) => Some(Box::new(tls)),
        Ok(Err(e)) => {
            // A scanner, a client that gave up, an unsupported version: nobody to tell.
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            None
        }
        Err(_) => {
            metrics().client_timeout(ClientTimeout::Header);
            None
        }
    }
}
