//! What the gateway writes itself: problem JSON for its own answers, and the rate-limit
//! headers on every response to an identified caller.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::Session;

use pingora::protocols::http::HttpTask;
use pingora::proxy::FailToProxy;

use super::ctx::Ctx;
use crate::problem::{self, Problem};
use crate::route::stated::Report;
use crate::telemetry::{metrics, ClientTimeout};

/// An interim (1xx) answer, after which the final one is still to come. `101 Switching
/// Protocols` is final: the connection then belongs to the new protocol.
pub fn is_interim(h: &ResponseHeader) -> bool {
    h.status.is_informational() && h.status != http::StatusCode::SWITCHING_PROTOCOLS
}

/// Writes the gateway's own answer: problem JSON, `Retry-After` where given, and the
/// rate-limit headers when the caller is identified. Returns `Ok(true)` ("response sent") for
/// `request_filter`.
pub async fn problem(
    session: &mut Session,
    ctx: &Ctx,
    p: Problem,
    detail: &str,
    retry_after: Option<u64>,
) -> Result<bool> {
    let cost = ctx
        .route
        .as_ref()
        .filter(|_| ctx.identity.is_some())
        .map(|r| r.cost);
    let remaining = ctx.outcome().map(|o| o.shown().1.remaining);
    let body = problem::body(p, detail, cost, remaining, retry_after);
    let mut h = ResponseHeader::build(p.status(), Some(10))?;
    h.insert_header("Content-Type", "application/problem+json")?;
    h.insert_header("Cache-Control", "no-store")?;
    send(session, ctx, h, Bytes::from(body), retry_after).await
}

/// Sends the gateway's own answer `h` with `body`, its `Content-Length` (but on a 204 or 304),
/// `Retry-After` where
/// given and the rate-limit headers; a request body it did not read is read past after it
/// ([`past_unread_body`]). `Ok(true)` ("response sent") for `request_filter`.
pub(super) async fn send(
    session: &mut Session,
    ctx: &Ctx,
    mut h: ResponseHeader,
    body: Bytes,
    retry_after: Option<u64>,
) -> Result<bool> {
    // None on a 204 or a 304 (RFC 9110 §8.6; a job's stored answer may be either).
    if !matches!(
        h.status,
        http::StatusCode::NO_CONTENT | http::StatusCode::NOT_MODIFIED
    ) {
        h.insert_header("Content-Length", body.len().to_string())?;
    }
    if let Some(ra) = retry_after {
        h.insert_header("Retry-After", ra.to_string())?;
    }
    rate_limit_headers(&mut h, ctx)?;
    let discard = past_unread_body(session);
    let written = async {
        if session.req_header().method == http::Method::HEAD
            && session.downstream_session.is_http2()
        {
            // A HEAD's answer has no content (RFC 9110 §9.3.2): its HEADERS end the stream. A
            // DATA frame after them is a protocol error to the client, which then loses the
            // answer. (Pingora's HTTP/1 writer drops a HEAD's body itself.)
            let end = vec![HttpTask::Header(Box::new(h), true)];
            return session
                .downstream_session
                .response_duplex_vec(end)
                .await
                .map(|_| ());
        }
        session.write_response_header(Box::new(h), false).await?;
        session.write_response_body(Some(body), true).await
    };
    if let Err(e) = written.await {
        use ErrorType::*;
        // The client's side failed to take it (gone, reset, too slow): nobody was answered.
        // Its source is the client's, so that it is no gateway ERROR, and the request counts
        // as 499 (`logging`). A failure of the gateway's own making stays as it is.
        let etype = e.etype().clone();
        if !matches!(
            etype,
            WriteError | WriteTimedout | ConnectionClosed | H2Error | ReadError
        ) {
            return Err(e);
        }
        return Err(Error::because(etype, NOBODY_ANSWERED, e).into_down());
    }
    if session.req_header().method == http::Method::HEAD && session.downstream_session.is_http2() {
        return Ok(true);
    }
    if discard {
        discard_unread_body(session).await;
    }
    Ok(true)
}

/// The context of the error of a gateway's own answer its client did not take.
const NOBODY_ANSWERED: &str = "the client left before its answer was written";

/// Whether `e` is the failure of a gateway's own answer its client did not take ([`send`]):
/// its request was answered to nobody.
pub(super) fn nobody_answered(e: &Error) -> bool {
    e.context
        .as_ref()
        .is_some_and(|c| c.as_str() == NOBODY_ANSWERED)
}

/// The most of an unread request body the gateway reads and discards after its own answer,
/// and how long it spends on it: a body beyond either ends the connection instead.
const DISCARD_AT_MOST: usize = 1 << 20;
const DISCARD_WITHIN: Duration = Duration::from_secs(2);

/// Before the gateway's own answer to an HTTP/1 request whose body it has not read (a refusal,
/// a job's answer): true if the body is to be read past after the answer
/// ([`discard_unread_body`]), so that the connection and what the client pipelined behind it go
/// on (DESIGN §3: never dropped). Otherwise the answer says `Connection: close` when there is
/// a body: one whose stated length is over [`DISCARD_AT_MOST`] (not worth reading for nothing),
/// or one the client holds back until a `100 Continue` it will not get (`Expect`), whose
/// absence leaves no way to tell where the next request starts. A connection that ends anyway
/// (keep-alive already off, after an upstream error or a stalled body; HTTP/2, whose streams
/// end on their own) is not worth reading for.
fn past_unread_body(session: &mut Session) -> bool {
    let s = &mut session.downstream_session;
    if s.get_keepalive().is_none() || s.is_body_empty() || s.is_body_done() {
        return false;
    }
    let req = s.req_header();
    let held_back = req.headers.contains_key(http::header::EXPECT);
    let too_long = req
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .is_some_and(|n| n > DISCARD_AT_MOST as u64);
    if held_back || too_long {
        session.set_keepalive(None);
        return false;
    }
    // Pingora would close: the body is read after the answer instead.
    s.set_close_on_response_before_downstream_finish(false);
    true
}

/// Reads and discards what is left of the request body after the gateway's own answer; if it
/// does not end within [`DISCARD_AT_MOST`] bytes and [`DISCARD_WITHIN`] (or breaks off), the
/// connection ends after this request. (Closing at once instead would drop what the client
/// pipelined, and its unread bytes could reset the connection before the client read the answer.)
async fn discard_unread_body(session: &mut Session) {
    let s = &mut session.downstream_session;
    let read = tokio::time::timeout(DISCARD_WITHIN, async {
        let mut n = 0;
        while let Some(b) = s.read_request_body().await? {
            n += b.len();
            if n > DISCARD_AT_MOST {
                return Ok(false);
            }
        }
        Ok::<_, Box<Error>>(true)
    })
    .await;
    if !matches!(read, Ok(Ok(true))) {
        session.set_keepalive(None);
    }
}

/// Adds `RateLimit-Policy`, `RateLimit` and `X-RateLimit-*` for the request's decision.
/// `X-RateLimit-Cost` is what this request was charged: nothing when refused or refunded.
pub fn rate_limit_headers(h: &mut ResponseHeader, ctx: &Ctx) -> Result<()> {
    let Some(id) = &ctx.identity else {
        return Ok(());
    };
    let Some(outcome) = ctx.outcome() else {
        // No decision to describe (the store was unavailable): the policy (the route's shared
        // budget's too), and nothing charged.
        let shared = ctx.route.as_ref().and_then(|r| r.shared());
        h.insert_header(
            "RateLimit-Policy",
            problem::policy_header(&id.policy, shared),
        )?;
        h.insert_header("X-RateLimit-Limit", id.policy.headers.limit.clone())?;
        h.insert_header("X-RateLimit-Cost", HeaderValue::from_static("0"))?;
        return Ok(());
    };
    // An admitted request is answered a hold (`max_delay`) and the upstream's work after its
    // decision: the budget drained meanwhile, and `t` says so. (The upstream's answer came
    // just now: no clock read here.) So is one the gateway answers itself after reading its
    // body (a 408, a job's 202): `t` counted to now.
    let t = &ctx.timing;
    let later = match (t.asked, t.upstream_start, t.upstream) {
        (Some(asked), Some(sent), Some(upstream)) if ctx.is_admitted() => {
            Some(outcome.later((sent + upstream).saturating_duration_since(asked)))
        }
        (Some(asked), _, None) if ctx.is_admitted() || ctx.job_submitted() => {
            Some(outcome.later(asked.elapsed()))
        }
        _ => None,
    };
    let outcome = later.as_ref().unwrap_or(outcome);
    let shared = ctx.route.as_ref().and_then(|r| r.shared());
    let headers =
        problem::rate_limit_headers(&id.policy, shared, outcome, ctx.charged(), ctx.share);
    // Ours replace any the upstream sent; appending is cheaper when there are none.
    let replace = h.headers.keys().any(problem::is_rate_limit_name);
    for (name, value) in headers {
        if replace {
            h.insert_header(name, value)?;
        } else {
            h.append_header(name, value)?;
        }
    }
    Ok(())
}

/// An interim answer (`103 Early Hints`) is relayed without the stated cost's header: it is
/// for the gateway (DESIGN §6), and only the final answer's counts.
pub fn drop_stated_cost(h: &mut ResponseHeader, ctx: &Ctx) {
    if let Some(name) = ctx
        .route
        .as_ref()
        .and_then(|r| r.fidelity.cost_from_response.as_ref())
    {
        h.remove_header(name);
    }
}

/// `cost_from_response`: reads what the upstream says the request cost (kept for settling
/// when the request was charged) and removes the header: it is for the gateway, not the
/// client.
pub fn take_stated_cost(h: &mut ResponseHeader, ctx: &mut Ctx) {
    let Some(route) = &ctx.route else {
        return;
    };
    let Some(name) = &route.fidelity.cost_from_response else {
        return;
    };
    let report = Report::read(&h.headers, name, route.cost);
    h.remove_header(name);
    if ctx.is_admitted() {
        ctx.report = Some(report);
    }
}

/// The request body stalled past `body_timeout` (HTTP/1: Pingora's read timeout; HTTP/2:
/// `front::BodyWatch`). The upstream had the request (its head, and the body so far): the
/// charge stands (DESIGN §3), else a stalled body would hold a slot for free; the slot is freed
/// in `logging`.
pub async fn body_stalled(session: &mut Session, ctx: &mut Ctx, headers_sent: bool) -> FailToProxy {
    metrics().client_timeout(ClientTimeout::Body);
    if !headers_sent {
        session.set_keepalive(None);
        let _ = problem(
            session,
            ctx,
            Problem::RequestTimeout,
            "the request body did not arrive within server.body_timeout",
            None,
        )
        .await;
    }
    FailToProxy {
        error_code: 408,
        can_reuse_downstream: false,
    }
}
