//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/admin/config`, `/admin/keys/{id}`,
//! `/admin/audit` (this instance's measured route costs, [`crate::audit`]).
//!
//! It runs on its own thread and tokio runtime, away from the proxy's workers, so a scrape
//! never competes with traffic and a stuck proxy still answers `/healthz`. It has limits of
//! its own (DESIGN §5): a request head within [`HEAD_TIMEOUT`], at most [`MAX_CONNECTIONS`]
//! open, and accept backs off when descriptors run out ([`crate::accept`]). `/admin/*` needs
//! `Authorization: Bearer $TOLLGATE_ADMIN_TOKEN` when that variable is set.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::budget;
use crate::policy::Policy;
use crate::state::Shared;
use crate::store::{BudgetView, Peek};

pub mod token;

type Resp = Response<Full<Bytes>>;

/// A request head must arrive within this, counted from accept and, on a kept-alive
/// connection, from the end of the previous response (so an idle connection is closed too).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Open admin connections; more are closed at once (the proxy's `max_connections` does not
/// cover this listener, and a flood of idle ones must not take every descriptor).
pub const MAX_CONNECTIONS: usize = 256;

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn json(status: StatusCode, v: serde_json::Value) -> Resp {
    reply(status, "application/json", v.to_string())
}

/// Starts serving on `listener` in a thread of its own.
pub fn spawn(listener: std::net::TcpListener, shared: Arc<Shared>) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let token = token::from_env()?;
    if token.is_none() && listener.local_addr().is_ok_and(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            admin = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            "the admin listener is reachable beyond loopback and TOLLGATE_ADMIN_TOKEN is not set: /admin/* is open to anyone who can connect"
        );
    }
    crate::background::spawn("tollgate-admin".into(), move || async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "admin listener failed");
                return;
            }
        };
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let mut backoff = crate::accept::Backoff::new("admin");
        loop {
            let (stream, _) = crate::accept::next(&listener, &mut backoff).await;
            // Past the limit the connection is closed at once: it costs no more than the accept.
            let Ok(permit) = open.clone().try_acquire_owned() else {
                continue;
            };
            let shared = shared.clone();
            let token = token.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let svc = hyper::service::service_fn(move |req| {
                    let shared = shared.clone();
                    let token = token.clone();
                    async move { Ok::<_, Infallible>(handle(req, &shared, token.as_deref()).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })?;
    Ok(())
}

/// GET, and HEAD (load balancers probe with it): the same answer without its body.
async fn handle(req: Request<Incoming>, shared: &Shared, token: Option<&str>) -> Resp {
    match *req.method() {
        hyper::Method::GET => answer(req, shared, token).await,
        hyper::Method::HEAD => without_body(answer(req, shared, token).await),
        _ => {
            let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
            r.headers_mut().insert(
                hyper::header::ALLOW,
                hyper::header::HeaderValue::from_static("GET, HEAD"),
            );
            r
        }
    }
}

/// A HEAD answer: the GET answer's status and headers, its length kept in `Content-Length`.
fn without_body(r: Resp) -> Resp {
    use hyper::body::Body;

    let len = r.body().size_hint().exact().unwrap_or(0);
    let (mut parts, _) = r.into_parts();
    parts
        .headers
        .insert(hyper::header::CONTENT_LENGTH, len.into());
    Response::from_parts(parts, Full::new(Bytes::new()))
}

async fn answer(req: Request<Incoming>, shared: &Shared, token: Option<&str>) -> Resp {
    let path = req.uri().path();
    if path.starts_with("/admin/") {
        if let Some(t) = token {
            let ok = req
                .headers()
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token)
                .is_some_and(|given| constant_time_eq(given.as_bytes(), t.as_bytes()));
            if !ok {
                return json(
                    StatusCode::UNAUTHORIZED,
                    serde_json::json!({"error": "admin token required"}),
                );
            }
        }
    }
    match path {
        "/metrics" => {
            shared.store.publish_gauges();
            reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                crate::telemetry::render(),
            )
        }
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            let draining = shared.drain.is_draining();
            let store_ok = shared.store.ready();
            let up = shared.upstream_addr.load().is_some();
            let body = serde_json::json!({
                "config": "loaded",
                "store": if shared.store.degraded() { "degraded (on_error policy in force)" } else { "ok" },
                "upstream_resolved": up,
                "draining": draining,
            });
            let status = if draining || !store_ok {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            json(status, body)
        }
        "/admin/audit" => match serde_json::to_value(crate::audit::snapshot(&shared.running())) {
            Ok(v) => json(StatusCode::OK, v),
            Err(e) => json(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({"error": e.to_string()}),
            ),
        },
        "/admin/config" => reply(
            StatusCode::OK,
            "application/yaml",
            shared.running().config.redacted_yaml(),
        ),
        "/admin/routes" => routes(shared).await,
        p if p.starts_with("/admin/keys/") => key(&p["/admin/keys/".len()..], shared).await,
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// `/admin/routes`: every route's cost, and each capped route's cap, slots running and
/// waiters queued (fleet-wide on Redis), with the keys holding and awaiting them by registry
/// id (`key:<8 hex>` outside the registry). 503 when the store cannot say.
async fn routes(shared: &Shared) -> Resp {
    let running = shared.running();
    let cfg = &running.config;
    let name = |k: &crate::store::fair::KeyRef| {
        cfg.keys
            .iter()
            .find(|(hash, _)| k.is(hash))
            .map_or_else(|| k.log_name(), |(_, e)| e.id.to_string())
    };
    let mut out = vec![];
    for r in cfg.router.routes() {
        let mut v = serde_json::json!({"route": &*r.label, "cost": r.cost});
        if let Some(cap) = r.max_in_flight {
            let q = match shared.store.route_queue(&r.label).await {
                Ok(q) => q,
                Err(e) => {
                    return json(
                        StatusCode::SERVICE_UNAVAILABLE,
                        serde_json::json!({"error": format!("store unavailable: {e}")}),
                    )
                }
            };
            let mut keys: Vec<serde_json::Value> = q
                .keys
                .iter()
                .map(|k| serde_json::json!({"key": name(&k.key), "running": k.running, "waiting": k.waiting}))
                .collect();
            keys.sort_by(|a, b| a["key"].as_str().cmp(&b["key"].as_str()));
            v["cap"] = cap.into();
            v["running"] = q.running.into();
            v["queued"] = q.queued.into();
            v["max_queue"] = r.queue.max_queue.into();
            v["max_in_flight_per_key"] = r.queue.per_key.into();
            v["keys"] = keys.into();
            // This process's board; a fleet's jobs (Redis) are among the queue's figures above.
            if r.jobs.is_some() && matches!(shared.store, crate::store::Store::Memory(_)) {
                let (queued, running) = shared.jobs.counts(&r.label);
                v["jobs"] = serde_json::json!({"queued": queued, "running": running});
            }
        }
        out.push(v);
    }
    json(StatusCode::OK, serde_json::json!({"routes": out}))
}

/// `/admin/keys/{id}`: the key's budgets, from the store or (while it cannot say) from the
/// `local` fallback's share in force; 503 when neither can.
async fn key(id: &str, shared: &Shared) -> Resp {
    let running = shared.running();
    let cfg = &running.config;
    let found = cfg
        .key_ids
        .get(id)
        .and_then(|h| Some((h, cfg.keys.get(h)?)));
    let Some((hash, entry)) = found else {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "no such key id in the registry"}),
        );
    };
    let policy = &entry.policy;
    match shared.store.peek(hash, &policy.limit, &policy.also).await {
        Some(Peek {
            views,
            local_share: None,
        }) => json(StatusCode::OK, key_json(id, policy, &views, "store")),
        Some(Peek {
            views,
            local_share: Some(n),
        }) => json(
            StatusCode::OK,
            key_json(id, &policy.share(n), &views, "local"),
        ),
        None => json(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"error": "store unavailable"}),
        ),
    }
}

/// `/admin/keys/{id}`: every budget of the key's plan in `budgets` (in the config's order),
/// and at the top the tightest of them, named in `budget`: the one with the fewest units left
/// now, the first on a tie (the rule of `X-RateLimit-*` on an admitted request; a refusal's
/// headers describe the refusing budget instead). A route's `shared` budget is not the key's
/// and is not shown. `source` says whose figures they are: `store`, or `local` (this
/// instance's share on the fallback; `policy` is then that share).
fn key_json(id: &str, policy: &Policy, views: &[BudgetView], source: &str) -> serde_json::Value {
    let budgets: Vec<serde_json::Value> = policy
        .budgets
        .iter()
        .zip(views)
        .map(|(b, v)| {
            serde_json::json!({
                "name": b.name,
                "limit": b.max_cost,
                "window_seconds": b.window.as_secs_f64(),
                "remaining": v.remaining,
                "reset_seconds": budget::reset_secs(v.reset_us),
            })
        })
        .collect();
    // `min_by_key` keeps the first of equals.
    let tightest = views
        .iter()
        .enumerate()
        .min_by_key(|(_, v)| v.remaining)
        .map_or(0, |(i, _)| i);
    let mut top = budgets
        .get(tightest)
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    if let Some(fields) = top.as_object_mut() {
        if let Some(name) = fields.remove("name") {
            fields.insert("budget".into(), name);
        }
        fields.insert("id".into(), id.into());
        fields.insert("plan".into(), policy.name.clone().into());
        fields.insert("budgets".into(), budgets.into());
        fields.insert("source".into(), source.into());
    }
    top
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is case-insensitive
/// (RFC 9110 §11.1).
fn bearer_token(v: &str) -> Option<&str> {
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The top level is the budget with the fewest units left, the first on a tie, whichever
    /// place it has in the plan.
    #[test]
    fn the_tightest_budget_is_at_the_top() {
        let policy = crate::policy::minute_and_day(50, 30);
        let view = |remaining| BudgetView {
            remaining,
            reset_us: 1_000_000,
        };
        for (left, top) in [
            ([5, 10], "pro-minute"),
            ([10, 5], "pro-day"),
            ([7, 7], "pro-minute"),
        ] {
            let v = key_json("k", &policy, &left.map(view), "store");
            assert_eq!(v["budget"], top, "{v}");
            assert_eq!(v["remaining"], left.iter().min().copied().unwrap(), "{v}");
            assert_eq!(v["budgets"][0]["remaining"], left[0], "{v}");
            assert_eq!(v["budgets"][1]["remaining"], left[1], "{v}");
            let limit = if top == "pro-minute" { 50 } else { 30 };
            assert_eq!(v["limit"], limit, "{v}");
        }
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc "), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
    }
}
