//! Async jobs at the Pingora edge (DESIGN §8): `GET`/`DELETE /_tollgate/jobs/<id>`, answered
//! from the job board: identified, never charged, counted like any request; and what a
//! submission's answer (`submit`) shares with them.

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::Session;

use super::ctx::{Ctx, Phase};
use super::{respond, Gateway};
use crate::decision::{self, Verdict};
use crate::jobs::{self, Cancel, View, PATH_PREFIX};
use crate::problem::{self, Problem};
use crate::route::Route;
use crate::state::Running;
use crate::store::{Standing, Store};
use std::sync::Arc;

/// The id a request about a job names (`/_tollgate/jobs/<id>`, a path the gateway keeps), None
/// for any other request (`job_in`, also `tollgate explain`'s). The path is read as routes are (DESIGN §3: normalized, matrix
/// parameters dropped, ASCII case ignored), so that no other spelling of it (`//`, `./`,
/// `%6aobs`, `jobs;v=1`, `/_TOLLGATE/…`) reaches the upstream; `/_tollgate/jobs` without an
/// id names none (empty), which no job has.
pub(super) fn job_named(session: &Session) -> Option<String> {
    let req = session.req_header();
    if decision::is_connect(req.method.as_str()) {
        return None; // refused as a tunnel by `decide`
    }
    job_in(req.raw_path())
}

/// The job a request target names (`job_named`'s), in origin-form or absolute-form
/// (`http://host/_tollgate/jobs/<id>` names the same job: DESIGN §3 classifies it as its
/// origin-form, and it must not reach the upstream either).
pub(crate) fn job_in(raw: &[u8]) -> Option<String> {
    if raw.first() == Some(&b'/') {
        return job_in_path(raw);
    }
    let target = std::str::from_utf8(raw).ok()?;
    job_in_path(decision::origin_path(target)?.as_bytes())
}

fn job_in_path(raw: &[u8]) -> Option<String> {
    if let Some(rest) = raw.strip_prefix(PATH_PREFIX.as_bytes()) {
        // As the gateway writes it in `Location`: the common case, nothing to normalize.
        let id = rest
            .split(|&b| b == b'?' || b == b'#')
            .next()
            .unwrap_or(rest);
        if !id.contains(&b'/') && !id.contains(&b'%') && !id.contains(&b';') {
            return Some(String::from_utf8_lossy(id).into_owned());
        }
    }
    // Most requests: no `_` and no `%`, so no spelling of the prefix; one pass, nothing else.
    if !raw.iter().any(|&b| b == b'_' || b == b'%') {
        return None;
    }
    let path = std::str::from_utf8(raw).ok()?.split(['?', '#']).next()?;
    let prefix = PATH_PREFIX.trim_end_matches('/');
    let normalized = crate::route::normalize_path(path).ok()?;
    let matched = crate::route::match_path(&normalized).ok()?;
    let head = matched.get(..prefix.len())?;
    if !head.eq_ignore_ascii_case(prefix) {
        return None;
    }
    match &matched[prefix.len()..] {
        "" | "/" => Some(String::new()),
        rest => rest.strip_prefix('/').map(str::to_string),
    }
}

/// Seconds until a job is likely done: its own run after the later of its waves ahead
/// (`position` over the cap, each the route's mean measured upstream time, 1 s before any
/// was measured) and its `max_delay` hold (it runs no sooner than its units are due).
pub(super) fn retry_after(
    running: &Running,
    route: &Route,
    position: usize,
    hold: std::time::Duration,
) -> u64 {
    let h = &running.metrics.get(route).upstream_duration;
    let n = h.get_sample_count();
    let mean = if n == 0 {
        1.0
    } else {
        h.get_sample_sum() / n as f64
    };
    let cap = f64::from(route.max_in_flight.unwrap_or(1).max(1));
    let ahead = (position as f64 / cap).ceil() * mean;
    (ahead.max(hold.as_secs_f64()) + mean)
        .ceil()
        .clamp(1.0, 3600.0) as u64
}

/// Headers the gateway writes, by the names it spells them with.
pub(super) type Own = Vec<(&'static str, HeaderValue)>;

/// Writes the gateway's answer (its own headers, or a stored upstream answer's) with the
/// rate-limit headers of the request's decision.
pub(super) async fn answer(
    session: &mut Session,
    ctx: &Ctx,
    status: u16,
    (own, stored): (Own, Vec<(HeaderName, HeaderValue)>),
    body: Bytes,
    retry_after: Option<u64>,
) -> Result<bool> {
    let mut h = ResponseHeader::build(status, Some(own.len() + stored.len() + 10))?;
    for (name, value) in own {
        h.append_header(name, value)?;
    }
    for (name, value) in stored {
        h.append_header(name, value)?;
    }
    respond::send(session, ctx, h, body, retry_after).await
}

pub(super) fn json_headers() -> Own {
    vec![
        ("Content-Type", HeaderValue::from_static("application/json")),
        ("Cache-Control", HeaderValue::from_static("no-store")),
    ]
}

async fn problem_answer(
    session: &mut Session,
    ctx: &Ctx,
    p: Problem,
    detail: &str,
) -> Result<bool> {
    problem_retry(session, ctx, p, detail, None).await
}

/// The gateway's problem JSON, with `Retry-After` (and its `retry_after` member) if given.
/// Its `cost` is 0 (a poll or a cancel costs nothing) and its `remaining` the budget as it
/// stands, when known, as in a synchronous refusal's body (DESIGN §3).
async fn problem_retry(
    session: &mut Session,
    ctx: &Ctx,
    p: Problem,
    detail: &str,
    retry_after: Option<u64>,
) -> Result<bool> {
    let own = vec![
        (
            "Content-Type",
            HeaderValue::from_static("application/problem+json"),
        ),
        ("Cache-Control", HeaderValue::from_static("no-store")),
    ];
    let remaining = ctx.outcome().map(|o| o.shown().1.remaining);
    let cost = ctx.identity.as_ref().map(|_| 0);
    let body = problem::body(p, detail, cost, remaining, retry_after);
    answer(
        session,
        ctx,
        p.status(),
        (own, vec![]),
        body.into(),
        retry_after,
    )
    .await
}

/// A job of `who`'s: in this process (memory store), or the fleet's record in Redis (an
/// error when Redis did not answer); its route, what a poll sees, and the process's own job.
async fn find(
    gw: &Gateway,
    id: &str,
    who: &crate::identity::Identity,
) -> std::result::Result<Option<Found>, crate::store::StoreError> {
    Ok(match &gw.shared.store {
        Store::Memory(_) => jobs::board()
            .get(id, &who.hash)
            .map(|(j, v)| (j.route.clone(), v, Some(j))),
        Store::Redis(_) => jobs::fleet::view(&gw.shared, id, &who.hash)
            .await?
            .map(|(r, v)| (r, v, None)),
    })
}

type Found = (Arc<str>, View, Option<Arc<jobs::Job>>);

/// `GET` (or `HEAD`) reads a job, `DELETE` cancels it; another key's, an unknown or an
/// expired job is 404 alike.
/// A job's poll or cancel: `id` is what [`job_named`] read from the path.
pub(super) async fn status(
    gw: &Gateway,
    session: &mut Session,
    ctx: &mut Ctx,
    id: String,
) -> Result<bool> {
    let running = ctx.running.clone().unwrap_or_else(|| gw.shared.running());
    ctx.running = Some(running.clone());
    let cfg = &running.config;
    let method = session.req_header().method.as_str().to_ascii_uppercase();
    let client = ctx.origin.map(|o| o.client);
    let identified = decision::identify(cfg, &session.req_header().headers, client);
    let who = match identified {
        Ok(w) => w,
        Err(r) => return gw.refuse(session, ctx, r).await,
    };
    let id = id.as_str();
    ctx.identity = Some(who.clone());
    let found = match find(gw, id, &who).await {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "a job poll found Redis unreachable");
            // Not 404: the job may be there, and the client should ask again.
            let detail = "the job store did not answer; ask again";
            return problem_retry(session, ctx, Problem::StoreUnavailable, detail, Some(1)).await;
        }
    };
    let job_id: Arc<str> = Arc::from(id);
    if let Some((route, _, _)) = &found {
        ctx.route = cfg.router.by_label(route).cloned();
    }
    // A cancel goes first, so that the figures, read once, have its refund in them.
    let cancelled = match &found {
        Some((_, _, local)) if method == "DELETE" => {
            match cancel(gw, &running, local.clone(), &job_id, &who).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::debug!(error = %e, "a job's cancel found Redis unreachable");
                    // Not 409: it may be cancelled (and then refunded) or not; ask again.
                    let detail = "the job store did not answer; ask again";
                    return problem_retry(session, ctx, Problem::StoreUnavailable, detail, Some(1))
                        .await;
                }
            }
        }
        _ => None,
    };
    // Cancelled by another `DELETE` just now, or gone meanwhile: 404, as its poll now is.
    let found = found.filter(|_| cancelled != Some(Cancel::Gone));
    let outcome = standing(gw, ctx, &who).await;
    ctx.phase = Phase::Job {
        decision: if method == "DELETE" {
            Verdict::JobCancel
        } else {
            Verdict::JobPoll
        },
        id: found.as_ref().map(|_| job_id.clone()),
        outcome,
    };
    let Some((_, view, _)) = found else {
        let detail = "no job with this id for this key (or its result has expired)";
        return problem_answer(session, ctx, Problem::JobNotFound, detail).await;
    };
    let route = ctx.route.clone();
    match (method.as_str(), view) {
        ("GET" | "HEAD", View::Done(stored)) => {
            let s = (*stored).clone();
            answer(session, ctx, s.status, (vec![], s.headers), s.body, None).await
        }
        ("GET" | "HEAD", view) => {
            let (state, position, due_in) = match view {
                View::Queued { position, due_in } => ("queued", position, due_in),
                View::Running { due_in } => ("running", 0, due_in),
                View::Done(_) => ("running", 0, std::time::Duration::ZERO),
            };
            // A job held for its `max_delay` turn runs no sooner than it is due.
            let ra = route.map_or(1, |r| retry_after(&running, &r, position, due_in));
            let body = serde_json::json!({"id": &*job_id, "status": state, "position": position});
            let body = Bytes::from(body.to_string());
            answer(session, ctx, 202, (json_headers(), vec![]), body, Some(ra)).await
        }
        ("DELETE", _) if cancelled == Some(Cancel::Cancelled) => {
            let body = serde_json::json!({"id": &*job_id, "status": "cancelled"});
            let body = Bytes::from(body.to_string());
            answer(session, ctx, 200, (json_headers(), vec![]), body, None).await
        }
        ("DELETE", _) => {
            let detail = "the job has started; it can no longer be cancelled";
            problem_answer(session, ctx, Problem::JobStarted, detail).await
        }
        _ => {
            let mut own = json_headers();
            own.push(("Allow", HeaderValue::from_static("GET, HEAD, DELETE")));
            answer(session, ctx, 405, (own, vec![]), Bytes::new(), None).await
        }
    }
}

/// The key's budgets as they stand, for the rate-limit headers of an answer that charges
/// nothing (DESIGN §3: every response to an identified request has them all): those of the
/// job's route (`ctx.route`), or the key's own when no job was found. None when the store
/// cannot say (the headers then say the policy and that nothing was charged).
pub(super) async fn standing(
    gw: &Gateway,
    ctx: &mut Ctx,
    who: &crate::identity::Identity,
) -> Option<Standing> {
    let also = match &ctx.route {
        Some(route) => decision::charged_also(route, who),
        None => who.policy.also.clone(),
    };
    let peek = gw
        .shared
        .store
        .peek(&who.hash, &who.policy.limit, &also)
        .await?;
    ctx.share = peek.local_share.unwrap_or(1);
    peek.standing()
}

/// `DELETE` on a job of this process, or of the fleet; an error: Redis did not answer.
async fn cancel(
    gw: &Gateway,
    running: &Running,
    local: Option<Arc<jobs::Job>>,
    id: &str,
    who: &crate::identity::Identity,
) -> Result<Cancel, crate::store::StoreError> {
    match local {
        Some(job) => Ok(job.cancel().await),
        None => jobs::fleet::cancel(&gw.shared, running, id, who).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_a_job_path_names_the_job() {
        let id = "0123456789abcdef0123456789abcdef";
        for spelled in [
            format!("/_tollgate/jobs/{id}"),
            format!("/_tollgate/jobs/{id}?x=1"),
            format!("/_tollgate//jobs/{id}"),
            format!("/_tollgate/./jobs/{id}"),
            format!("/x/../_tollgate/jobs/{id}"),
            format!("/_tollgate/%6aobs/{id}"),
            format!("/%5Ftollgate/jobs/{id}"),
            format!("/_tollgate/jobs;v=1/{id}"),
            format!("/_TOLLGATE/Jobs/{id}"),
        ] {
            assert_eq!(job_in(spelled.as_bytes()).as_deref(), Some(id), "{spelled}");
        }
        for none in ["/_tollgate/jobs", "/_tollgate/jobs/", "/_tollgate/jobs/?x"] {
            assert_eq!(job_in(none.as_bytes()).as_deref(), Some(""), "{none}");
        }
        for other in [
            "/api/items/1",
            "/_tollgate/jobsx/1",
            "/_tollgate",
            "/a/_tollgate/jobs/1",
            "/%2e",
        ] {
            assert_eq!(job_in(other.as_bytes()), None, "{other}");
        }
    }
}
