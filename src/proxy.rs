//! The Pingora edge: translates each proxy phase into calls on plain modules.
//!
//! `request_filter` normalizes, classifies, identifies and admits (or refuses with problem
//! JSON); `upstream_peer` / `upstream_request_filter` forward to the normalized path;
//! `response_filter` adds the rate-limit headers; `fail_to_proxy` refunds and answers 502/504;
//! `logging` — which Pingora runs for every request, whatever happened — releases slots,
//! records metrics and writes the access log.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use async_trait::async_trait;
use bytes::Bytes;
use http::HeaderValue;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};

use crate::budget::{self, Outcome, Verdict};
use crate::config::Config;
use crate::identity::{self, Identity};
use crate::problem::{self, Problem};
use crate::route::{normalize_path, Route};
use crate::store::{Admission, AdmitRequest, Lease, Store};
use crate::telemetry::metrics;

/// State shared by every request and the admin listener; the config is swapped on reload.
pub struct Shared {
    pub config: ArcSwap<Config>,
    /// The upstream's resolved address (`None` until its name resolves).
    pub upstream_addr: ArcSwapOption<SocketAddr>,
    pub store: Store,
    /// Requests between `request_filter` and `logging`: what a graceful shutdown waits for.
    pub active: AtomicUsize,
}

pub struct Gateway {
    pub shared: Arc<Shared>,
}

/// Per-request state.
pub struct Ctx {
    start: Instant,
    config: Option<Arc<Config>>,
    route: Option<Arc<Route>>,
    identity: Option<Identity>,
    admit: Option<AdmitRequest>,
    outcome: Option<Outcome>,
    lease: Option<Lease>,
    /// The normalized path, when it differs from what the client sent.
    forward_path: Option<String>,
    problem: Option<Problem>,
    store_time: Duration,
    queued: Duration,
    upstream_start: Option<Instant>,
    upstream_time: Option<Duration>,
    charged: bool,
    refund: bool,
    counted: bool,
}

fn header_str<'a>(req: &'a RequestHeader, name: &str) -> Option<&'a [u8]> {
    req.headers.get(name).map(|v| v.as_bytes())
}

/// Writes a refusal: problem JSON, `Retry-After` where given, rate-limit headers when the
/// caller is identified.
async fn respond_problem(
    session: &mut Session,
    ctx: &mut Ctx,
    p: Problem,
    detail: &str,
    retry_after: Option<u64>,
) -> Result<bool> {
    let cost = ctx.route.as_ref().map(|r| r.cost);
    let remaining = ctx.outcome.map(|o| o.remaining);
    let body = problem::body(
        p,
        detail,
        cost.filter(|_| ctx.identity.is_some()),
        remaining,
        retry_after,
    );
    let mut h = ResponseHeader::build(p.status(), Some(10))?;
    h.insert_header("Content-Type", "application/problem+json")?;
    h.insert_header("Content-Length", body.len().to_string())?;
    h.insert_header("Cache-Control", "no-store")?;
    if let Some(ra) = retry_after {
        h.insert_header("Retry-After", ra.to_string())?;
    }
    add_rate_limit_headers(&mut h, ctx)?;
    ctx.problem = Some(p);
    // A request body we never read would be taken for the next request: close unless bodyless.
    let req = session.req_header();
    let bodyless = req.headers.get("transfer-encoding").is_none()
        && req
            .headers
            .get("content-length")
            .is_none_or(|v| v.as_bytes() == b"0");
    if !bodyless {
        session.set_keepalive(None);
    }
    session.write_response_header(Box::new(h), false).await?;
    session
        .write_response_body(Some(Bytes::from(body)), true)
        .await?;
    Ok(true)
}

fn add_rate_limit_headers(h: &mut ResponseHeader, ctx: &Ctx) -> Result<()> {
    if let (Some(id), None) = (&ctx.identity, &ctx.outcome) {
        // No decision to describe (the store was unavailable): the policy, and nothing charged.
        h.insert_header("RateLimit-Policy", id.policy.headers.policy.clone())?;
        h.insert_header("X-RateLimit-Limit", id.policy.headers.limit.clone())?;
        h.insert_header("X-RateLimit-Cost", HeaderValue::from_static("0"))?;
        return Ok(());
    }
    if let (Some(id), Some(o), Some(r)) = (&ctx.identity, &ctx.outcome, &ctx.route) {
        // X-RateLimit-Cost is what this request was charged: nothing when refused or refunded.
        let charged = if ctx.charged && !ctx.refund {
            r.cost
        } else {
            0
        };
        let headers = problem::rate_limit_headers(&id.policy, o, charged);
        // Ours replace any the upstream sent; appending is cheaper when there are none.
        let replace = headers
            .iter()
            .any(|(name, _)| h.headers.contains_key(*name));
        for (name, value) in headers {
            if replace {
                h.insert_header(name, value)?;
            } else {
                h.append_header(name, value)?;
            }
        }
    }
    Ok(())
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            start: Instant::now(),
            config: None,
            route: None,
            identity: None,
            admit: None,
            outcome: None,
            lease: None,
            forward_path: None,
            problem: None,
            store_time: Duration::ZERO,
            queued: Duration::ZERO,
            upstream_start: None,
            upstream_time: None,
            charged: false,
            refund: false,
            counted: false,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        self.shared.active.fetch_add(1, Ordering::Relaxed);
        ctx.counted = true;
        let cfg = self.shared.config.load_full();
        ctx.config = Some(cfg.clone());

        // 1. Normalize: the route is chosen from, and the upstream receives, the canonical path.
        let req = session.req_header();
        let route = match normalize_path(req.uri.path()) {
            Ok(path) => {
                let route = cfg
                    .router
                    .classify(req.method.as_str(), &path)
                    .route
                    .clone();
                if let Cow::Owned(p) = path {
                    ctx.forward_path = Some(p);
                }
                route
            }
            Err(e) => {
                ctx.route = Some(cfg.router.default_route().clone());
                return respond_problem(session, ctx, Problem::BadPath, &e.to_string(), None).await;
            }
        };
        ctx.route = Some(route.clone());

        // 2. Identify. The raw key never leaves this block.
        let id = {
            let req = session.req_header();
            let key = identity::extract_key(&cfg.sources, |n| header_str(req, n));
            let client = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip());
            identity::identify(&cfg, key, client)
        };
        let identity = match id {
            Ok(i) => i,
            Err(e) => {
                let detail = match e {
                    identity::Unauthenticated::Missing => "an API key is required",
                    identity::Unauthenticated::Unknown => "the API key is not known",
                };
                return respond_problem(session, ctx, Problem::Unauthenticated, detail, None).await;
            }
        };

        // 3. Admit: budget, per-key cap and route cap in one store decision.
        let req = AdmitRequest {
            key: identity.hash,
            limit: identity.policy.limit,
            cost: route.cost,
            key_cap: identity.policy.max_in_flight_per_key,
            route: route.label.clone(),
            route_cap: route.max_in_flight,
            queue_timeout: route.queue_timeout,
        };
        ctx.identity = Some(identity);
        let t = Instant::now();
        let admission = self.shared.store.admit(&req).await;
        let elapsed = t.elapsed();
        ctx.admit = Some(req);
        match admission {
            Admission::Admitted {
                outcome,
                lease,
                queued,
            } => {
                ctx.outcome = Some(outcome);
                ctx.lease = Some(lease);
                ctx.charged = true;
                ctx.queued = queued;
                ctx.store_time = elapsed.saturating_sub(queued);
                route.metrics.in_flight.inc();
                if route.max_in_flight.is_some() {
                    route.metrics.queue_wait.observe(queued.as_secs_f64());
                }
                if let Verdict::Admit { delay_us } = outcome.verdict {
                    if delay_us > 0 {
                        // max_delay: the units are reserved; hold the request until they are due.
                        tokio::time::sleep(Duration::from_micros(delay_us)).await;
                    }
                }
                Ok(false)
            }
            Admission::OverBudget(outcome) => {
                ctx.store_time = elapsed;
                ctx.outcome = Some(outcome);
                let retry = match outcome.verdict {
                    Verdict::Reject { retry_after_us } => budget::retry_after_secs(retry_after_us),
                    Verdict::Admit { .. } => 1,
                };
                let detail = format!(
                    "this request costs {} units and {} are left; retry in {retry} s",
                    route.cost, outcome.remaining
                );
                respond_problem(session, ctx, Problem::QuotaExceeded, &detail, Some(retry)).await
            }
            Admission::KeyBusy(outcome) => {
                ctx.store_time = elapsed;
                ctx.outcome = Some(outcome);
                respond_problem(
                    session,
                    ctx,
                    Problem::ConcurrencyLimit,
                    "this key has as many requests in flight as its plan allows",
                    Some(1),
                )
                .await
            }
            Admission::RouteBusy { outcome, queued } => {
                ctx.outcome = Some(outcome);
                ctx.queued = queued;
                ctx.store_time = elapsed.saturating_sub(queued);
                route.metrics.queue_wait.observe(queued.as_secs_f64());
                let detail = format!(
                    "{} has {} requests in flight; no slot freed within {} ms",
                    route.label,
                    route.max_in_flight.unwrap_or(0),
                    route.queue_timeout.as_millis()
                );
                respond_problem(session, ctx, Problem::RouteBusy, &detail, Some(1)).await
            }
            Admission::Unavailable => {
                ctx.store_time = elapsed;
                respond_problem(
                    session,
                    ctx,
                    Problem::StoreUnavailable,
                    "the rate-limit store is unavailable",
                    Some(1),
                )
                .await
            }
        }
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let Some(cfg) = ctx.config.as_ref() else {
            return Error::e_explain(ErrorType::InternalError, "no config for request");
        };
        let Some(addr) = self.shared.upstream_addr.load_full() else {
            return Error::e_explain(ErrorType::ConnectNoRoute, "upstream host did not resolve");
        };
        let up = &cfg.upstream;
        let mut peer = HttpPeer::new(*addr, up.tls, up.host.clone());
        peer.options.connection_timeout = Some(up.connect_timeout);
        peer.options.total_connection_timeout = Some(up.connect_timeout * 2);
        peer.options.read_timeout = Some(up.read_timeout);
        peer.options.write_timeout = Some(up.read_timeout);
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(p) = &ctx.forward_path {
            let pq = match upstream.uri.query() {
                Some(q) => format!("{p}?{q}"),
                None => p.clone(),
            };
            let uri = pq
                .parse::<http::Uri>()
                .map_err(|e| Error::because(ErrorType::InternalError, "normalized uri", e))?;
            upstream.set_uri(uri);
        }
        if let Some(cfg) = &ctx.config {
            // The Host the client sent to us, replacing any X-Forwarded-Host it sent itself.
            upstream.remove_header("x-forwarded-host");
            if let Some(host) = upstream.remove_header("host") {
                upstream.append_header("X-Forwarded-Host", host)?;
            }
            upstream.append_header("Host", cfg.upstream.host_header.clone())?;
        }
        if let Some(ip) = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip())
        {
            match upstream
                .headers
                .get("x-forwarded-for")
                .and_then(|v| v.to_str().ok())
            {
                Some(prev) => {
                    let xff = format!("{prev}, {ip}");
                    upstream.insert_header("X-Forwarded-For", xff)?;
                }
                None => {
                    upstream.append_header("X-Forwarded-For", ip.to_string())?;
                }
            }
        }
        upstream.insert_header("X-Forwarded-Proto", HeaderValue::from_static("http"))?;
        ctx.upstream_start = Some(Instant::now());
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if ctx.upstream_time.is_none() {
            ctx.upstream_time = ctx.upstream_start.map(|s| s.elapsed());
        }
        add_rate_limit_headers(resp, ctx)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        use ErrorType::*;
        let headers_sent = session.response_written().is_some();
        let problem = match (e.esource(), e.etype()) {
            (_, HTTPStatus(code)) => {
                if !headers_sent {
                    let _ = session.respond_error(*code).await;
                }
                return FailToProxy {
                    error_code: *code,
                    can_reuse_downstream: false,
                };
            }
            (ErrorSource::Upstream, ReadTimedout | WriteTimedout) => Problem::GatewayTimeout,
            (ErrorSource::Upstream, _)
            | (_, ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError) => {
                Problem::BadGateway
            }
            (ErrorSource::Downstream, _) => {
                // The client went away or sent garbage; nobody to answer.
                let code = match e.etype() {
                    WriteError | ReadError | ConnectionClosed => 0,
                    _ => 400,
                };
                if code > 0 && !headers_sent {
                    let _ = session.respond_error(code).await;
                }
                return FailToProxy {
                    error_code: code,
                    can_reuse_downstream: false,
                };
            }
            _ => {
                if !headers_sent {
                    let _ = session.respond_error(500).await;
                }
                return FailToProxy {
                    error_code: 500,
                    can_reuse_downstream: false,
                };
            }
        };
        if headers_sent {
            // The upstream answered and then failed mid-body: it did the work, keep the charge.
            return FailToProxy {
                error_code: problem.status(),
                can_reuse_downstream: false,
            };
        }
        // The upstream never produced a response: refund, before answering, so that the
        // client's next request already sees the units back.
        if ctx.charged {
            if let (Some(req), Some(lease)) = (&ctx.admit, &ctx.lease) {
                self.shared.store.refund(req, lease.charge()).await;
            }
            ctx.refund = true;
        }
        if ctx.upstream_time.is_none() {
            ctx.upstream_time = ctx.upstream_start.map(|s| s.elapsed());
        }
        let detail = match problem {
            Problem::GatewayTimeout => {
                "the upstream did not answer in time; the request was not charged"
            }
            _ => "the upstream could not be reached; the request was not charged",
        };
        // Pingora will not reuse this connection after an upstream error: say so, so that the
        // client doesn't send its next request into a closing socket.
        session.set_keepalive(None);
        let _ = respond_problem(session, ctx, problem, detail, None).await;
        FailToProxy {
            error_code: problem.status(),
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        if let Some(lease) = ctx.lease.take() {
            lease.release().await;
        }
        let status = session
            .response_written()
            .map(|r| r.status.as_u16())
            .unwrap_or(0);
        // Requests Pingora refused before `request_filter` count under `default`.
        let route = match &ctx.route {
            Some(r) => r.clone(),
            None => self.shared.config.load().router.default_route().clone(),
        };
        let rm = &route.metrics;
        let elapsed = ctx.start.elapsed();
        rm.request(status);
        rm.request_duration.observe(elapsed.as_secs_f64());
        if let Some(u) = ctx.upstream_time {
            rm.upstream_duration.observe(u.as_secs_f64());
        }
        if ctx.charged {
            rm.in_flight.dec();
            if !ctx.refund {
                rm.cost_units.inc_by(route.cost);
            }
        }
        let decision = match ctx.problem {
            Some(p) => match p.reason() {
                Some(reason) => {
                    // A full route with no queue configured is refused at once: `in_flight`;
                    // `route_busy` is a full route that stayed full for its queue_timeout.
                    let reason = if p == Problem::RouteBusy && route.queue_timeout.is_zero() {
                        "in_flight"
                    } else {
                        reason
                    };
                    rm.rejection(reason);
                    if let Some(id) = ctx.identity.as_ref().and_then(|i| i.id.as_deref()) {
                        metrics().rejections_by_key.with_label_values(&[id]).inc();
                    }
                    reason
                }
                None => "refunded",
            },
            None if ctx.charged => "admitted",
            None => "error",
        };
        // Field expressions are only evaluated when the access log is enabled.
        tracing::info!(
            target: "tollgate::access",
            method = session.req_header().method.as_str(),
            route = &*route.label,
            key = ctx.identity.as_ref().map(|i| i.log_name()).as_deref().unwrap_or("-"),
            cost = if ctx.charged && !ctx.refund { route.cost } else { 0 },
            decision,
            status,
            latency_ms = elapsed.as_secs_f64() * 1e3,
            upstream_ms = ctx.upstream_time.map(|u| u.as_secs_f64() * 1e3),
            store_ms = ctx.store_time.as_secs_f64() * 1e3,
            queue_ms = ctx.queued.as_secs_f64() * 1e3,
            error = e.map(|e| e.etype().as_str()),
        );
        if ctx.counted {
            self.shared.active.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
