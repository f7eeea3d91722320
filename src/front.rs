//! The front door: what happens to a client connection before and around the HTTP requests
//! on it — the open-connection limit, the deadline for a request head (slowloris), the
//! send-stall timeout, and the shield that lets an admitted request on a capped route run to
//! the upstream's end after its client has gone.
//!
//! Pingora has no accept or close hook and no total deadline for a request head, so the
//! gateway accepts connections itself ([`Listeners`]: counted from accept, TLS handshakes
//! within `server.header_timeout`) and [`FrontDoor`] wraps Pingora's `HttpProxy`: it wraps the
//! stream in [`Tracked`], and runs Pingora's HTTP/1 keep-alive loop itself so that each request
//! head can be raced against `server.header_timeout`. TLS connections (`server.tls`) come
//! through the same door; those that chose HTTP/2 by ALPN are handed to Pingora's h2 server,
//! still counted and stall-timed, with one request session per stream.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use pingora::apps::{HttpServerApp, ReusedHttpStream, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::{Stream, UniqueIDType, ALPN};
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use tokio::sync::Notify;
use tokio::time::Sleep;

use crate::state::Shared;
use crate::telemetry::{metrics, ClientTimeout};
use pingora::proxy::ProxyHttp;

mod body_watch;
mod late;
mod listen;
mod stream;

pub use crate::config::ClientLimits;
pub use body_watch::BodyWatch;
pub use late::{drain_upstream, LateAnswer, Learned};
pub use listen::Listeners;
pub use stream::Tracked;

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n` (RFC 9113 §3.4).
const H2_PREFACE_LEN: u32 = 24;

/// What the front door and the request phases know about one connection.
#[derive(Debug)]
pub struct ConnState {
    /// Cleared at the start of each request head, set by `early_request_filter`.
    head_done: AtomicBool,
    /// When the current head's first byte arrived (µs since `epoch`; 0 = not yet).
    first_byte_us: AtomicU64,
    first_byte: Notify,
    /// When the connection was accepted: the first head (and a TLS handshake before it) must
    /// be in within `header_timeout` of it.
    epoch: Instant,
    /// While on, a client that went away is hidden from Pingora: writes are discarded and
    /// reads pend, so the proxy loop reads the upstream's answer to its end.
    shield: AtomicBool,
    /// The client went away (seen through the shield).
    gone: AtomicBool,
    send_timeout_us: AtomicU64,
    send_timed_out: AtomicBool,
    /// Requests come as HTTP/1 heads, read by the front door's keep-alive loop.
    http1: AtomicBool,
    /// Pingora refused a head it could not parse, before any hook: the gateway's own answer
    /// went out instead of its empty 400 (see [`Tracked`]).
    refused_head: AtomicBool,
    /// Bytes of the HTTP/2 connection preface still to come (0: arrived, or HTTP/1).
    preface_left: AtomicU32,
    /// The connection, taken back from a request Pingora would end it after
    /// ([`keep_after_failure`]), for the keep-alive loop's next request.
    kept: std::sync::Mutex<Option<ReusedHttpStream>>,
}

impl ConnState {
    fn new(send_timeout: Duration, accepted: Instant) -> ConnState {
        ConnState {
            head_done: AtomicBool::new(false),
            first_byte_us: AtomicU64::new(0),
            first_byte: Notify::new(),
            epoch: accepted,
            shield: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            send_timeout_us: AtomicU64::new(send_timeout.as_micros() as u64),
            send_timed_out: AtomicBool::new(false),
            http1: AtomicBool::new(false),
            refused_head: AtomicBool::new(false),
            preface_left: AtomicU32::new(0),
            kept: std::sync::Mutex::new(None),
        }
    }

    fn now_us(&self) -> u64 {
        (self.epoch.elapsed().as_micros() as u64).max(1)
    }

    fn await_head(&self) {
        self.head_done.store(false, Ordering::SeqCst);
        self.first_byte_us.store(0, Ordering::SeqCst);
    }

    /// The request head has been parsed (called from the first request phase).
    pub fn head_done(&self) {
        self.head_done.store(true, Ordering::SeqCst);
    }

    fn head_complete(&self) -> bool {
        self.head_done.load(Ordering::SeqCst)
    }

    /// Resolves when the head has been in transit for `timeout`: counted from accept for a new
    /// connection (a TLS handshake's time included), from its first byte on a kept-alive one (idle time is `idle_timeout`'s, see
    /// [`IdleTimer`]; so is a pipelined head's part read ahead with the previous request when
    /// no more of it comes).
    /// Once the head is complete the deadline no longer matters and no timer is armed: the
    /// front door polls the request first, so a head that arrives whole (the usual case)
    /// costs no timer at all.
    async fn head_deadline(&self, timeout: Duration, from_now: bool) {
        if from_now {
            if self.head_complete() {
                return std::future::pending().await;
            }
            tokio::time::sleep_until((self.epoch + timeout).into()).await;
            return;
        }
        loop {
            if self.head_complete() {
                return std::future::pending().await;
            }
            let notified = self.first_byte.notified();
            let at = self.first_byte_us.load(Ordering::SeqCst);
            if at > 0 {
                let elapsed = Duration::from_micros(self.now_us().saturating_sub(at));
                tokio::time::sleep(timeout.saturating_sub(elapsed)).await;
                return;
            }
            notified.await;
        }
    }

    /// Ends `timeout` after accept if the HTTP/2 connection preface has not arrived whole by
    /// then (a client that sent part of it and stopped is as silent as one that sent
    /// nothing); else never.
    async fn without_preface_for(&self, timeout: Duration) {
        tokio::time::sleep_until((self.epoch + timeout).into()).await;
        if self.preface_left.load(Ordering::Relaxed) == 0 {
            std::future::pending::<()>().await;
        }
    }

    /// `n` more bytes read: counted off the preface while it is awaited.
    fn read_bytes(&self, n: usize) {
        let left = self.preface_left.load(Ordering::Relaxed);
        if left > 0 {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            self.preface_left
                .store(left.saturating_sub(n), Ordering::Relaxed);
        }
    }

    /// How long the current request head has been in transit (zero before its first byte).
    fn head_elapsed(&self) -> Duration {
        match self.first_byte_us.load(Ordering::SeqCst) {
            0 => Duration::ZERO,
            at => Duration::from_micros(self.now_us().saturating_sub(at)),
        }
    }

    /// A byte of the current request head has arrived.
    fn head_begun(&self) -> bool {
        self.first_byte_us.load(Ordering::SeqCst) > 0
    }

    /// Hides a client that goes away from here on (see [`ConnState::shield`]).
    pub fn set_shield(&self, on: bool) {
        self.shield.store(on, Ordering::SeqCst);
    }

    fn shielded(&self) -> bool {
        self.shield.load(Ordering::SeqCst)
    }

    /// The client went away while shielded: the connection must not be reused.
    pub fn client_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// A write stalled past `send_timeout` (already counted).
    pub fn send_timed_out(&self) -> bool {
        self.send_timed_out.load(Ordering::SeqCst)
    }

    /// Whatever is written now is Pingora's refusal of an HTTP/1 head it could not parse (a
    /// duplicate `Content-Length`, a header line without a colon, `Transfer-Encoding` in
    /// HTTP/1.0, …): it writes nothing else before the first hook has marked the head done.
    fn refusing_head(&self) -> bool {
        self.http1.load(Ordering::Relaxed) && !self.head_complete()
    }

    fn send_timeout(&self) -> Duration {
        Duration::from_micros(self.send_timeout_us.load(Ordering::Relaxed))
    }
}

/// `server.idle_timeout` on an HTTP/1 connection: one timer for the connection's life. It is
/// registered once and after each re-arming, and otherwise only looked at, so that the wait for
/// each request costs no timer work; it fires at most once per `idle_timeout` on a busy
/// connection (its task is woken then, and re-arms it for the current wait).
struct IdleTimer {
    sleep: Pin<Box<Sleep>>,
    registered: bool,
}

impl IdleTimer {
    fn new(timeout: Duration) -> IdleTimer {
        IdleTimer {
            sleep: Box::pin(tokio::time::sleep(timeout)),
            registered: false,
        }
    }

    /// Ready when the connection has waited `timeout` since `since` without a byte of its
    /// next request; pending once one has come (the head's own deadline counts from then).
    fn poll_idle(
        &mut self,
        cx: &mut Context<'_>,
        conn: &ConnState,
        since: Instant,
        timeout: Duration,
    ) -> Poll<()> {
        loop {
            if !self.registered {
                self.registered = true;
                // Unconstrained: with the task's budget spent, a `Sleep` pends without
                // registering, and this timer would never fire.
                let mut sleep = tokio::task::unconstrained(self.sleep.as_mut());
                if Pin::new(&mut sleep).poll(cx).is_pending() {
                    return Poll::Pending;
                }
            } else if !self.sleep.is_elapsed() {
                return Poll::Pending;
            }
            if conn.head_begun() || conn.head_complete() {
                return Poll::Pending;
            }
            let due = since + timeout;
            if Instant::now() >= due {
                return Poll::Ready(());
            }
            self.sleep.as_mut().reset(due.into());
            self.registered = false;
        }
    }
}

/// The connection state of a request's stream, if it came through the front door.
pub fn conn_of(session: &pingora::proxy::Session) -> Option<Arc<ConnState>> {
    let stream = session.downstream_session.stream()?;
    (**stream)
        .as_any()
        .downcast_ref::<Tracked>()
        .map(|t| t.conn().clone())
}

/// Pingora's proxy behind the connection-level limits; [`Listeners`] accepts for it.
pub struct FrontDoor<SV> {
    proxy: Arc<HttpProxy<SV>>,
    shared: Arc<Shared>,
    open: listen::OpenConnections,
}

impl<SV> FrontDoor<SV> {
    pub fn new(mut proxy: HttpProxy<SV>, shared: Arc<Shared>) -> FrontDoor<SV> {
        let mut options = proxy.server_options.take().unwrap_or_default();
        // An HTTP/2 connection without an open stream is idle: closed after `idle_timeout`
        // (the value at start; Pingora's h2 server takes it once).
        options.h2_idle_timeout = Some(shared.running().config.client_limits.idle_timeout);
        // Pingora would answer CONNECT with an empty 405 before any hook: let it through to
        // `request_filter`, which refuses it as `bad-path` (DESIGN §3: a target that does not
        // start with '/') and closes the connection. Nothing is ever tunnelled.
        options.allow_connect_method_proxying = true;
        proxy.server_options = Some(options);
        FrontDoor {
            proxy: Arc::new(proxy),
            shared,
            open: listen::OpenConnections::default(),
        }
    }
}

impl<SV> FrontDoor<SV>
where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    /// Serves one client connection (counted by the caller) until it closes.
    /// Serves a connection accepted at `accepted` (its TLS handshake done).
    async fn serve(self: &Arc<Self>, stream: Stream, accepted: Instant, shutdown: &ShutdownWatch) {
        let limits = self.shared.running().config.client_limits;
        let conn = Arc::new(ConnState::new(limits.send_timeout, accepted));
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
        let stream: Stream = Box::new(Tracked::new(stream, conn.clone()));
        if matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
            // Pingora's h2 server waits for the client's preface without a deadline: a
            // connection whose preface has not arrived whole within header_timeout is closed.
            // (Connections without an open stream are closed after `idle_timeout`.)
            conn.preface_left.store(H2_PREFACE_LEN, Ordering::Relaxed);
            let serve = ServerApp::process_new(&self.proxy, stream, shutdown);
            tokio::pin!(serve);
            tokio::select! {
                _ = &mut serve => {}
                _ = conn.without_preface_for(limits.header_timeout) => {
                    metrics().client_timeout(ClientTimeout::Header);
                }
            }
            return;
        }
        // Pingora's own HTTP/1 keep-alive loop, with each request head raced against its
        // deadline.
        conn.http1.store(true, Ordering::Relaxed);
        let mut session = ServerSession::new_http1(stream);
        session.set_keepalive(if *shutdown.borrow() { None } else { Some(60) });
        // Requests a client pipelines are answered one after the other, in order (RFC 9112
        // §9.3.2). Without this Pingora answers the first and closes the connection, and the
        // bytes it read ahead (the next requests) are lost. The settings below carry the flag
        // and the read-ahead from each request to the next.
        session.set_pipelining_enabled(true);
        // Between two requests the connection is idle: closed after `idle_timeout`. (Pingora's
        // own keep-alive timeout would not do: it takes every HTTP/1.1 request as a wish to
        // keep the connection open for ever, and it would arm a timer per request.)
        let mut idle = IdleTimer::new(limits.idle_timeout);
        let mut first = true;
        loop {
            conn.await_head();
            let since = if first { conn.epoch } else { Instant::now() };
            let request = HttpServerApp::process_new_http(&self.proxy, session, shutdown);
            tokio::pin!(request);
            let idle_wait = poll_fn(|cx| idle.poll_idle(cx, &conn, since, limits.idle_timeout));
            let done = tokio::select! {
                // The request first: see `ConnState::head_deadline`.
                biased;
                r = &mut request => r,
                _ = conn.head_deadline(limits.header_timeout, first) => {
                    if conn.head_complete() {
                        request.await
                    } else {
                        // Dropping the request closes the connection; nothing was decided yet.
                        metrics().client_timeout(ClientTimeout::Header);
                        return;
                    }
                }
                // Before the first request, header_timeout is the bound.
                _ = idle_wait, if !first => {
                    // Nothing of a next request has come: a normal end, not a client's fault.
                    return;
                }
            };
            // A connection taken back from a failed request: Pingora itself returns none then
            // (asked only then: no lock per request).
            let kept = || conn.kept.lock().unwrap_or_else(|e| e.into_inner()).take();
            let Some(done) = done.or_else(kept) else {
                if conn.refused_head.load(Ordering::SeqCst) {
                    crate::proxy::malformed_head(&self.shared, peer, conn.head_elapsed());
                }
                return;
            };
            let (stream, settings) = done.consume();
            session = ServerSession::new_http1(stream);
            if let Some(s) = settings {
                s.apply_to_session(&mut session);
            }
            first = false;
        }
    }

    /// At shutdown: wakes keep-alive reads parked in Pingora so that they don't hold it up.
    async fn cleanup(&self) {
        self.proxy.http_cleanup().await
    }
}

/// Takes an HTTP/1 connection back from a request whose upstream failed, once the gateway
/// has answered for it with the whole request read: Pingora ends the connection after any
/// upstream error, and what the client pipelined behind the request would be lost (DESIGN
/// §3: never dropped). Called last in `logging`; the session keeps a stand-in socket for
/// Pingora to drop, and the keep-alive loop reads the next request from the connection,
/// with what was read ahead of it.
pub async fn keep_after_failure(session: &mut pingora::proxy::Session, conn: &ConnState) {
    use pingora::apps::HttpPersistentSettings;
    // The stand-in: one end of a socket pair whose other end is already closed (this path
    // runs only after an upstream failure).
    let Ok((stand_in, _)) = tokio::net::UnixStream::pair() else {
        return;
    };
    let stand_in = pingora::protocols::l4::stream::Stream::from(stand_in);
    let stand_in = ServerSession::new_http1(Box::new(stand_in));
    let session = std::mem::replace(&mut *session.downstream_session, stand_in);
    let settings = HttpPersistentSettings::for_session(&session);
    // `None` when the connection is not to go on after all (the client asked to close it,
    // or its unread body could not be read past).
    if let Ok(Some(stream)) = session.finish().await {
        let reused = ReusedHttpStream::from_reusable_stream(stream, settings);
        *conn.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(reused);
    }
}

/// Resolves when the client has closed its connection (FIN or RST), reading nothing from it:
/// a duplicate of the socket is watched for read-closed readiness, so body bytes still waiting
/// in the socket stay there for the upstream. Pends forever if the socket cannot be watched.
pub async fn client_gone(fd: UniqueIDType) {
    use std::os::fd::BorrowedFd;
    use tokio::io::unix::AsyncFd;
    use tokio::io::{Interest, Ready};
    // SAFETY: `fd` is the socket of the session that awaits this future inside one of its own
    // phases, so it is open for the whole call; only a duplicate is kept.
    let dup = match unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() {
        Ok(d) => d,
        Err(_) => return std::future::pending().await,
    };
    // SAFETY: the AsyncFd owns the duplicate, which stays open until it is dropped.
    let Ok(watch) = (unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }) else {
        return std::future::pending().await;
    };
    loop {
        let Ok(mut ready) = watch.readable().await else {
            return std::future::pending().await;
        };
        if ready.ready().is_read_closed() || ready.ready().is_error() {
            return;
        }
        // Only data (a request body, a pipelined request): keep waiting.
        ready.clear_ready_matching(Ready::READABLE);
    }
}

/// Resolves when the client of this request went away, reading nothing: for HTTP/1 the
/// connection closed ([`client_gone`]); for HTTP/2 the client reset the stream (or the
/// connection ended), which leaves the connection's other streams alone.
pub async fn client_left(session: &mut ServerSession) {
    // An HTTP/1 session has a client socket of its own; an HTTP/2 stream shares one.
    if let Some(fd) = session.stream().map(|s| s.id()) {
        return client_gone(fd).await;
    }
    match session.watch_h2_stream_close() {
        // Any answer (a reset's reason, or a stream error) means the stream is gone.
        Some(closed) => {
            let _ = closed.await;
        }
        None => std::future::pending().await,
    }
}
