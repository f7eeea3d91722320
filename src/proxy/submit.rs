//! A job submission at the Pingora edge (DESIGN §8), once `decide` has identified and
//! classified it, in this order: a body declared over `max_request_body` is 413 (nothing
//! charged); the charge (`jobs::charge`: 429 at once if the budget refuses, and no job); a
//! `100 Continue` to a client that waits for one before its body; the body, read whole and
//! bounded, each read within `server.body_timeout`; then the job, made and queued
//! (`jobs::submit`), answered 202 with its location. A body that does not arrive whole
//! (stalled: 408; framed wrongly: 400; its client gone) or is over the bound as it arrives
//! (413) makes no job, and its charge is given back: the upstream never had anything.

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::{Error, ErrorType};
use std::time::Duration;

use super::ctx::{Ctx, Phase};
use super::jobs::{answer, json_headers, retry_after, standing};
use super::{forward, Gateway};
use crate::decision::{self, Refusal, Verdict};
use crate::jobs::{self, JobRequest, Origin, PATH_PREFIX};
use crate::problem::Problem;

/// The body length a request declares (`Content-Length`), if it does.
fn declared_length(session: &Session) -> Option<u64> {
    session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Whether the client holds its body back until it is told to send it (`Expect:
/// 100-continue`, RFC 9110 §10.1.1), and has one to send.
fn waits_for_continue(session: &mut Session) -> bool {
    !session.is_body_empty()
        && !session.is_body_done()
        && session
            .req_header()
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The whole request body, or `None` when it is over `max` as it arrives. A gap of `gap`
/// between two reads is a stalled body (408, as on the synchronous path): Pingora times an
/// HTTP/1 body's reads itself, but not an HTTP/2 stream's, whose DATA frames could otherwise
/// be awaited for ever.
async fn read_body(session: &mut Session, max: u64, gap: Duration) -> Result<Option<Bytes>> {
    if waits_for_continue(session) {
        // Admitted: the client may send its body now (else it waits out its own timer).
        // Pingora takes any answer written before the body was read for one that ends the
        // connection: not this interim one, after which the body is read whole.
        let s = &mut session.downstream_session;
        s.set_close_on_response_before_downstream_finish(false);
        let written = s.write_continue_response().await;
        s.set_close_on_response_before_downstream_finish(true);
        written.map_err(|e| e.into_down())?;
    }
    let mut buf = BytesMut::new();
    // The client's errors (a malformed chunk, a stalled body) as the synchronous path has
    // them: 400 or 408, not the gateway's 500.
    loop {
        let read = session.downstream_session.read_request_body();
        let Ok(read) = tokio::time::timeout(gap, read).await else {
            let e = Error::explain(ErrorType::ReadTimedout, "the job's request body stalled");
            return Err(e.into_down());
        };
        let Some(chunk) = read.map_err(|e| e.into_down())? else {
            break;
        };
        if (buf.len() + chunk.len()) as u64 > max {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Some(buf.freeze()))
}

/// Removes the headers the client's `Connection` names, before the gateway adds its own (as
/// Pingora does to a synchronous request before `upstream_request_filter`): a client cannot
/// make the job's upstream lose `X-Request-Id` or `key_id_header` by naming them.
fn without_nominated(up: &mut RequestHeader) {
    let nominated: Vec<http::HeaderName> = up
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter_map(|t| http::HeaderName::from_bytes(t.trim_ascii()).ok())
        .collect();
    for name in nominated {
        up.remove_header(&name);
    }
}

/// The head a job sends: as forwarded, over HTTP/1.1 with the whole body's length, without
/// hop-by-hop headers and without the `respond-async` preference (the gateway applied it).
/// Hop-by-hop are what Pingora strips from a synchronous request: those the client's
/// `Connection` names ([`without_nominated`], before), and the standard ones
/// (`Proxy-Authorization` among them).
fn job_head(up: &mut RequestHeader, body_len: usize) -> Result<()> {
    for name in [
        "transfer-encoding",
        "content-length",
        "expect",
        "connection",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "http2-settings",
        "trailer",
    ] {
        up.remove_header(name);
    }
    up.set_version(http::Version::HTTP_11);
    let with_body = matches!(up.method, Method::POST | Method::PUT | Method::PATCH);
    if body_len > 0 || with_body {
        up.insert_header(http::header::CONTENT_LENGTH, body_len.to_string())?;
    }
    let others: Vec<String> = up
        .headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| {
            let token = p.split(';').next().unwrap_or("").trim();
            !p.is_empty() && !token.eq_ignore_ascii_case("respond-async")
        })
        .map(str::to_string)
        .collect();
    up.remove_header("prefer");
    if !others.is_empty() {
        up.insert_header("Prefer", others.join(", "))?;
    }
    Ok(())
}

fn too_large(max: u64) -> Refusal {
    let detail = format!(
        "the request body is over async.max_request_body ({}); nothing was charged",
        crate::config::size::format_size(max)
    );
    Refusal {
        problem: Problem::PayloadTooLarge,
        detail,
        retry_after: None,
        outcome: None,
        queued: std::time::Duration::ZERO,
        waited_for_a_slot: false,
        reason: Problem::PayloadTooLarge.reason(),
    }
}

/// The store's refusal of a job (nothing charged, no job): sent as the synchronous path's.
async fn refused(
    gw: &Gateway,
    session: &mut Session,
    ctx: &mut Ctx,
    route: &crate::route::Route,
    admission: crate::store::Admission,
) -> Result<bool> {
    match decision::judge_job(route, admission) {
        Err(r) => gw.refuse(session, ctx, r).await,
        Ok(a) => {
            a.lease.release().await;
            Error::e_explain(ErrorType::InternalError, "a job refusal that admitted")
        }
    }
}

/// A classified, identified request that becomes a job: 413 over the body bound, the store's
/// refusal (429, 503), or 202 with the job's location; a body that does not arrive whole is
/// answered by `fail_to_proxy` (408, 400). Nothing is charged unless the job is made.
pub(super) async fn submit(gw: &Gateway, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
    let (Some(admit), Some(route), Some(running), Some(who)) = (
        ctx.job.take(),
        ctx.route.clone(),
        ctx.running.clone(),
        ctx.identity.clone(),
    ) else {
        return Error::e_explain(ErrorType::InternalError, "job without its decision");
    };
    let Some(rules) = route.jobs else {
        return Error::e_explain(ErrorType::InternalError, "job on a route without async");
    };
    let max = rules.max_request_body;
    if declared_length(session).is_some_and(|n| n > max) {
        // Nothing charged, nothing decided: the headers say what is left as it stands.
        let mut refusal = too_large(max);
        refusal.outcome = standing(gw, ctx, &who).await;
        return gw.refuse(session, ctx, refusal).await;
    }
    // Charged as usual before the body is taken (DESIGN §8): 429 at once, no job.
    let asked = std::time::Instant::now();
    ctx.timing.asked = Some(asked);
    let charged = jobs::charge(&gw.shared, &route, admit).await;
    // Its `store decision` span and `store_ms`, as a request's.
    ctx.timing.store = asked.elapsed();
    let charged = match charged {
        Ok(charged) => charged,
        Err(admission) => return refused(gw, session, ctx, &route, admission).await,
    };
    let gap = running.config.client_limits.body_timeout;
    let body = match read_body(session, max, gap).await {
        Ok(Some(body)) => body,
        Ok(None) => {
            let mut refusal = too_large(max);
            refusal.outcome = Some(charged.give_back().await);
            return gw.refuse(session, ctx, refusal).await;
        }
        Err(e) => {
            // No job, and the upstream never had the body: the charge goes back before
            // `fail_to_proxy` answers (408, 400), with every rate-limit header.
            ctx.phase = Phase::Job {
                decision: Verdict::Refunded,
                id: None,
                outcome: Some(charged.give_back().await),
            };
            return Err(e);
        }
    };
    let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
    let mut up = session.req_header().clone();
    without_nominated(&mut up);
    forward::request(&mut up, ctx, &session.req_header().headers, tls)?;
    if let Some(trace) = &ctx.trace {
        trace.job_request(&mut up)?;
    }
    job_head(&mut up, body.len())?;
    let origin = Origin {
        method: up.method.as_str().to_string(),
        key: who.log_name().to_string(),
        request_id: ctx.request_id.clone(),
        client: ctx.origin.map(|o| o.client),
    };
    let request = JobRequest { header: up, body };
    let submitted = jobs::submit(
        &gw.shared,
        running.clone(),
        route.clone(),
        &who,
        charged,
        request,
        origin,
    )
    .await;
    let sub = match submitted {
        Ok(sub) => sub,
        Err(admission) => return refused(gw, session, ctx, &route, admission).await,
    };
    let id = sub.id.clone();
    // Admitted (DESIGN §8: a job is an admitted request answered 202): in the last minute's
    // figures from its submission, as a request from its admission.
    running
        .metrics
        .get(&route)
        .count_recent(true, std::time::Instant::now());
    ctx.phase = Phase::Job {
        decision: Verdict::JobSubmitted,
        id: Some(id.clone()),
        outcome: Some(sub.standing),
    };
    let mut own = json_headers();
    let location = HeaderValue::from_str(&format!("{PATH_PREFIX}{id}"))
        .map_err(|e| Error::because(ErrorType::InternalError, "location", e))?;
    own.push(("Location", location));
    own.push((
        "Preference-Applied",
        HeaderValue::from_static("respond-async"),
    ));
    let ra = retry_after(&running, &route, sub.position, sub.hold);
    let body = serde_json::json!({"id": &*id, "status": "queued", "position": sub.position});
    let body = Bytes::from(body.to_string());
    answer(session, ctx, 202, (own, vec![]), body, Some(ra)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_head_has_its_length_and_no_hop_by_hop_headers_or_respond_async() {
        let mut up = RequestHeader::build("POST", b"/reports/generate", None).unwrap();
        up.set_version(http::Version::HTTP_2);
        up.insert_header("Transfer-Encoding", "chunked").unwrap();
        up.insert_header("Expect", "100-continue").unwrap();
        up.insert_header("Connection", "keep-alive, X-Foo").unwrap();
        up.insert_header("X-Foo", "hop").unwrap();
        up.insert_header("Proxy-Authorization", "Basic eA==")
            .unwrap();
        up.append_header("Prefer", "respond-async, wait=5").unwrap();
        up.append_header("Prefer", "return=minimal").unwrap();
        up.insert_header("X-Custom", "kept").unwrap();
        without_nominated(&mut up);
        job_head(&mut up, 11).unwrap();
        let h = &up.headers;
        assert_eq!(up.version, http::Version::HTTP_11);
        assert_eq!(h.get("content-length").unwrap(), "11");
        for gone in [
            "transfer-encoding",
            "expect",
            "connection",
            "x-foo",
            "proxy-authorization",
        ] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
        let prefer: Vec<_> = h.get_all("prefer").iter().collect();
        assert_eq!(prefer, ["wait=5, return=minimal"]);
        assert_eq!(h.get("x-custom").unwrap(), "kept");

        let mut only = RequestHeader::build("GET", b"/r", None).unwrap();
        only.insert_header("Prefer", "respond-async").unwrap();
        job_head(&mut only, 0).unwrap();
        assert!(only.headers.get("prefer").is_none());
        assert!(only.headers.get("content-length").is_none());
    }
}
