//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/admin/config`, `/admin/keys/{id}`,
//! `/admin/audit` (this instance's measured route costs, [`crate::audit`]), `/admin/routes`
//! ([`routes`]), `/admin/status` ([`status`]) and the status page `/admin/` ([`page`]).
//!
//! It runs on its own thread and tokio runtime, away from the proxy's workers, so a scrape
//! never competes with traffic and a stuck proxy still answers `/healthz`. It has limits of
//! its own (DESIGN §5): a request head within [`HEAD_TIMEOUT`], at most [`MAX_CONNECTIONS`]
//! open, and accept backs off when descriptors run out ([`crate::accept`]). `/admin/*` needs
//! `Authorization: Bearer $TOLLGATE_ADMIN_TOKEN` when that variable is set, or the session
//! cookie a browser gets for showing it ([`token::AdminAuth`]).

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

pub mod page;
pub mod routes;
pub mod status;
pub mod token;

use token::AdminAuth;

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

/// Starts serving on `listener` in a thread of its own, `/admin/*` behind `token` if any
/// (`token::from_env`, checked at start before anything is bound).
pub fn spawn(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    token: Option<Arc<str>>,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let token = token.map(AdminAuth::new);
    status::started();
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
        let mut backoff = crate::accept::Backoff::new(crate::telemetry::Listener::Admin);
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
                    async move { Ok::<_, Infallible>(handle(req, &shared, token.as_ref()).await) }
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
async fn handle(req: Request<Incoming>, shared: &Shared, token: Option<&AdminAuth>) -> Resp {
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

async fn answer(req: Request<Incoming>, shared: &Shared, auth: Option<&AdminAuth>) -> Resp {
    let path = req.uri().path();
    if let (Some(auth), true) = (auth, path.starts_with("/admin/")) {
        if let Some(r) = page::gate(path, req.headers(), auth) {
            return r;
        }
    }
    match path {
        "/metrics" => {
            shared.store.publish_gauges();
            crate::telemetry::retire_routes();
            reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                crate::telemetry::render(),
            )
        }
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => readyz(shared),
        "/admin/audit" => match crate::audit::instance_view(&shared.running()) {
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
        "/admin/routes" => routes::routes(shared).await,
        "/admin/status" => json(StatusCode::OK, status::status(shared)),
        "/admin" | "/admin/" | "/admin/session" | "/admin/status.js" | "/admin/status.css" => {
            page::serve(path)
        }
        p if p.starts_with("/admin/keys/") => {
            // An id sent percent-encoded (`acme%2Dprod`) is the same id.
            let raw = &p["/admin/keys/".len()..];
            match percent_encoding::percent_decode_str(raw).decode_utf8() {
                Ok(id) => key(&id, shared).await,
                Err(_) => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

fn readyz(shared: &Shared) -> Resp {
    let draining = shared.drain.is_draining();
    let store_ok = shared.store.ready();
    let up = shared.running().upstream_addr.is_some();
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
    // The one the key's requests' `X-RateLimit-*` describe.
    let tightest = budget::tightest(views.iter().map(|v| (v.remaining, v.reset_us)));
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
}
