//! A small SaaS-like API to put behind the gateway: for `tollgate demo`, and as the real HTTP
//! upstream of the integration tests (which read its counters to see what got through).
//!
//! - `/items`, `/items/{id}`, anything else: fast JSON echo of method, path and query;
//! - `/reports/generate`: slow (the configured report time, ~2 s in the demo);
//! - `?delay_ms=N` on any path: answer after N ms;
//! - `?status=N` on the echo paths: answer with status N (an upstream failing with 500, 503…);
//! - `?ratelimit=1` on the echo paths: the answer carries rate-limit headers of its own
//!   (`RateLimit`, `X-RateLimit-Remaining`, and `X-RateLimit-Used`, which is not one of the
//!   gateway's), as a provider behind the gateway may send; `?ratelimit=2`: only the last two;
//! - `?work_ms=N` on any path: N ms of work that goes on even if the caller hangs up (like a
//!   report the database keeps generating), counted in `current` until it is done;
//! - `/analytics/query?rows=N`: states what it cost, `X-Actual-Cost: ceil(N/1000)` (a query
//!   that scans more rows costs more; `cost_from_response` settles on it);
//! - `?actual_cost=V` on the echo paths: the answer carries `X-Actual-Cost: V`, verbatim (so
//!   tests can state any cost, or garbage);
//! - `/bytes/{n}`: streams n bytes (`?pace_ms=N`: a 64 KiB frame every N ms); `POST /upload`: counts the body as it streams in
//!   (sending `100 Continue` first when asked; `?then_ms=N`: answers N ms after the body);
//! - `/__stats` (GET) and `/__reset` (POST): per-path request counts and peak concurrency.
//!
//! The last requests received are kept (`SampleApi::seen`), so tests can check what the gateway
//! forwarded: the exact request target and every header.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct PathStats {
    pub count: u64,
    pub current: u64,
    pub max_concurrent: u64,
}

/// One request as the API received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// The request target as sent: origin-form `/path?query`, or absolute-form.
    pub target: String,
    /// Every header, in order (names lower-case).
    pub headers: Vec<(String, String)>,
    /// When it arrived (tests check how callers were spaced).
    pub at: std::time::Instant,
    /// When its handler was done with it (its answer made), if it is.
    pub ended: Option<std::time::Instant>,
    id: u64,
}

impl Seen {
    /// The values of header `name`, in order.
    pub fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// How many requests `seen` keeps: the demo runs for as long as it likes.
const SEEN_KEPT: usize = 1024;

#[derive(Debug, Default)]
pub struct SampleApi {
    pub report_time: Duration,
    stats: Mutex<BTreeMap<String, PathStats>>,
    seen: Mutex<VecDeque<Seen>>,
    /// The id of the next request `seen` records.
    next_id: std::sync::atomic::AtomicU64,
    /// `POST /upload` bodies that arrived whole (a gateway that passes on a truncated body as
    /// if it were complete shows here).
    uploads_completed: std::sync::atomic::AtomicU64,
}

type Body = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

fn full(status: StatusCode, ct: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    if let Ok(v) = ct.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

struct InFlight<'a> {
    api: &'a SampleApi,
    path: String,
    /// Its record in `seen`.
    id: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.api.stats.lock() {
            if let Some(p) = s.get_mut(&self.path) {
                p.current = p.current.saturating_sub(1);
            }
        }
        if let Ok(mut seen) = self.api.seen.lock() {
            if let Some(r) = seen.iter_mut().rev().find(|r| r.id == self.id) {
                r.ended = Some(std::time::Instant::now());
            }
        }
    }
}

impl SampleApi {
    pub fn new(report_time: Duration) -> Arc<Self> {
        Arc::new(SampleApi {
            report_time,
            stats: Mutex::default(),
            seen: Mutex::default(),
            next_id: Default::default(),
            uploads_completed: Default::default(),
        })
    }

    /// How many `POST /upload` bodies arrived whole.
    pub fn uploads_completed(&self) -> u64 {
        self.uploads_completed
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The last requests received (at most 1024), oldest first; `/__stats` and `/__reset` aside.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Records `req` in `seen`: its id there.
    fn record(&self, req: &Request<Incoming>) -> u64 {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seen = Seen {
            method: req.method().as_str().to_string(),
            target: req.uri().to_string(),
            headers: req
                .headers()
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            at: std::time::Instant::now(),
            ended: None,
            id,
        };
        if let Ok(mut s) = self.seen.lock() {
            if s.len() == SEEN_KEPT {
                s.pop_front();
            }
            s.push_back(seen);
        }
        id
    }

    pub fn stats(&self) -> BTreeMap<String, PathStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn enter(&self, path: &str, id: u64) -> InFlight<'_> {
        if let Ok(mut s) = self.stats.lock() {
            let p = s.entry(path.to_string()).or_default();
            p.count += 1;
            p.current += 1;
            p.max_concurrent = p.max_concurrent.max(p.current);
        }
        InFlight {
            api: self,
            path: path.to_string(),
            id,
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        match path.as_str() {
            "/__stats" => {
                let body = serde_json::to_string(&self.stats()).unwrap_or_default();
                return full(StatusCode::OK, "application/json", body);
            }
            "/__reset" => {
                self.reset();
                return full(StatusCode::OK, "application/json", "{}");
            }
            _ => {}
        }
        let id = self.record(&req);
        if let Some(ms) = param(&query, "work_ms") {
            return self.work(path, ms, id).await;
        }
        let _guard = self.enter(&path, id);
        let delay = match param(&query, "delay_ms") {
            Some(ms) => Duration::from_millis(ms),
            None if path == "/reports/generate" => self.report_time,
            None => Duration::ZERO,
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if path == "/upload" {
            let then = Duration::from_millis(param(&query, "then_ms").unwrap_or(0));
            return self.upload(req, then).await;
        }
        if let Some(n) = path
            .strip_prefix("/bytes/")
            .and_then(|n| n.parse::<u64>().ok())
        {
            let pace = Duration::from_millis(param(&query, "pace_ms").unwrap_or(0));
            return stream_bytes(n, pace);
        }
        echo(req, &path, &query).await
    }

    /// `/__reset`: forgets what was seen.
    fn reset(&self) {
        if let Ok(mut s) = self.stats.lock() {
            s.clear();
        }
        if let Ok(mut s) = self.seen.lock() {
            s.clear();
        }
    }

    /// `?work_ms=N`: works N ms, whether or not the client stays.
    async fn work(self: Arc<Self>, path: String, ms: u64, id: u64) -> Response<Body> {
        // The work runs in a task of its own: when the connection goes away, hyper drops
        // this handler, but not the work, as a database would go on generating a report.
        let api = self.clone();
        let p = path.clone();
        let work = tokio::spawn(async move {
            let _guard = api.enter(&p, id);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        });
        let _ = work.await;
        let body = serde_json::json!({ "path": path, "worked_ms": ms });
        full(StatusCode::OK, "application/json", body.to_string())
    }

    /// `/upload`: reads the whole body (hyper answers `Expect: 100-continue` with a
    /// `100 Continue` as it starts), works `then` and answers the body's length.
    async fn upload(&self, req: Request<Incoming>, then: Duration) -> Response<Body> {
        let mut n: u64 = 0;
        let mut body = req.into_body();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => n += f.data_ref().map(|d| d.len() as u64).unwrap_or(0),
                Err(_) => return full(StatusCode::BAD_REQUEST, "text/plain", "body error"),
            }
        }
        self.uploads_completed
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if !then.is_zero() {
            tokio::time::sleep(then).await;
        }
        full(
            StatusCode::OK,
            "application/json",
            serde_json::json!({ "bytes": n }).to_string(),
        )
    }
}

/// A number in the query: `name=N`.
fn param(query: &str, name: &str) -> Option<u64> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// Anything else: the request echoed as JSON (its credentials left out), with the status,
/// stated cost and provider headers the query asks for.
async fn echo(req: Request<Incoming>, path: &str, query: &str) -> Response<Body> {
    let param = |name: &str| param(query, name);
    let echo_body = param("echo_body") == Some(1);
    let headers: BTreeMap<String, String> = req
        .headers()
        .iter()
        .filter(|(k, _)| {
            !k.as_str().eq_ignore_ascii_case("x-api-key") && k.as_str() != "authorization"
        })
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let method = req.method().as_str().to_string();
    let mut body = serde_json::json!({
        "method": method,
        "path": path,
        "query": query,
        "headers": headers,
    });
    if echo_body {
        // `?echo_body=1`: the request body as received (tests of what a job forwarded).
        let received = match req.into_body().collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(_) => return full(StatusCode::BAD_REQUEST, "text/plain", "body error"),
        };
        body["body"] = received.into();
    }
    let status = param("status")
        .and_then(|n| u16::try_from(n).ok())
        .and_then(|n| StatusCode::from_u16(n).ok())
        .unwrap_or(StatusCode::OK);
    let mut r = full(status, "application/json", body.to_string());
    let h = r.headers_mut();
    if let Some(v) = stated_cost(path, query, param("rows")) {
        h.insert("x-actual-cost", v);
    }
    if let Some(which) = param("ratelimit") {
        provider_rate_limit_headers(h, which);
    }
    r
}

/// `?ratelimit=1`: the rate-limit headers a provider behind the gateway may send (`2`: only
/// the de-facto two).
fn provider_rate_limit_headers(h: &mut hyper::HeaderMap, which: u64) {
    if which == 1 {
        h.insert(
            "ratelimit",
            HeaderValue::from_static("\"upstream\";r=999;t=1"),
        );
    }
    h.insert("x-ratelimit-remaining", HeaderValue::from_static("999"));
    h.insert("x-ratelimit-used", HeaderValue::from_static("5"));
}

/// The `X-Actual-Cost` an echo answer states: `?actual_cost=` as sent, else one unit per
/// thousand rows (rounded up) on `/analytics/query?rows=N`.
fn stated_cost(path: &str, query: &str, rows: Option<u64>) -> Option<HeaderValue> {
    let verbatim = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("actual_cost="));
    if let Some(v) = verbatim {
        return HeaderValue::from_str(v).ok();
    }
    match (path, rows) {
        ("/analytics/query", Some(n)) => Some(HeaderValue::from(n.div_ceil(1000))),
        _ => None,
    }
}

fn stream_bytes(n: u64, pace: Duration) -> Response<Body> {
    const CHUNK: u64 = 64 * 1024;
    let chunk = Bytes::from(vec![b'x'; CHUNK as usize]);
    let stream = futures_stream(n, chunk, pace);
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut()
        .insert(hyper::header::CONTENT_LENGTH, n.into());
    r
}

/// Yields `n` bytes in 64 KiB frames, generated as they are sent (never buffered whole), each
/// frame `pace` after the one before.
fn futures_stream(
    n: u64,
    chunk: Bytes,
    pace: Duration,
) -> impl futures_core::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Send {
    struct S {
        left: u64,
        chunk: Bytes,
        pace: Duration,
        wait: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    }
    impl futures_core::Stream for S {
        type Item = Result<Frame<Bytes>, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            if self.left == 0 {
                return std::task::Poll::Ready(None);
            }
            if !self.pace.is_zero() {
                let pace = self.pace;
                let wait = self
                    .wait
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(pace)));
                if std::future::Future::poll(wait.as_mut(), cx).is_pending() {
                    return std::task::Poll::Pending;
                }
                self.wait = None;
            }
            let take = self.left.min(self.chunk.len() as u64);
            self.left -= take;
            let data = self.chunk.slice(..take as usize);
            std::task::Poll::Ready(Some(Ok(Frame::data(data))))
        }
    }
    S {
        left: n,
        chunk,
        pace,
        wait: None,
    }
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, api: Arc<SampleApi>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve_connection(stream, api.clone()));
    }
}

/// Serves the API on one connection (plain TCP, or TLS in the tests' https upstream).
pub async fn serve_connection<I>(io: I, api: Arc<SampleApi>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let api = api.clone();
        async move { Ok::<_, Infallible>(api.handle(req).await) }
    });
    // Like most backends, it finishes a request whose client half-closed the connection
    // (the gateway shuts its side when it stops waiting at read_timeout): the work goes on.
    let _ = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(io), svc)
        .await;
}
