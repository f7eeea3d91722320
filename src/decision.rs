//! Where the cost is decided. A request's method, target, headers and client address become the
//! route it is charged as and the identity that pays; with the store's answer, it is either
//! admitted (on what terms) or refused (with which problem, detail, `Retry-After` and metric
//! reason).
//!
//! No Pingora types: `proxy` translates each phase into these calls and back, and
//! `tollgate explain` runs the very same classification, so the two can never disagree.

// A refusal is returned by value once per request; boxing it would allocate on every 429.
#![allow(clippy::result_large_err)]

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use crate::budget;
use crate::config::Config;
use crate::identity::{self, Identity, Unauthenticated};
use crate::problem::Problem;
use crate::route::{normalize_path, BadPath, Route};
use crate::store::fair::Fair;
use crate::store::{Admission, AdmitRequest, Bucket, Extra, Lease, Standing};

pub use crate::reason::{Reason, Verdict};

/// What a request is charged as, and what the upstream receives for it.
#[derive(Debug, Clone)]
pub struct Classified {
    pub route: Arc<Route>,
    /// The request target to forward (origin-form, normalized) when it differs from what the
    /// client sent; `None` forwards the client's target unchanged.
    pub forward_target: Option<String>,
    /// The method to forward when the client's differs in case only from the one it is
    /// charged as (`delete` → `DELETE`).
    pub forward_method: Option<&'static str>,
}

/// A request the gateway answers itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub problem: Problem,
    pub detail: String,
    pub retry_after: Option<u64>,
    /// The budget as the store last saw it, for the rate-limit headers (`None` when there was no
    /// decision: the caller is unidentified or the store was unavailable).
    pub outcome: Option<Standing>,
    /// Time spent waiting for a route slot before the refusal.
    pub queued: Duration,
    /// It waited for a route slot (until its queue_timeout, or its key's share's): not one a
    /// full queue, or a route without a queue, refused at once. `tollgate_queue_wait_seconds`
    /// counts waits.
    pub waited_for_a_slot: bool,
    /// `tollgate_rejections_total{reason}`; `None` for answers that are not a gateway refusal.
    pub reason: Option<Reason>,
}

impl Refusal {
    fn new(problem: Problem, detail: impl Into<String>) -> Refusal {
        Refusal {
            problem,
            detail: detail.into(),
            retry_after: None,
            outcome: None,
            queued: Duration::ZERO,
            waited_for_a_slot: false,
            reason: problem.reason(),
        }
    }
}

/// A request the store admitted: charged, holding its slots until `lease` is dropped.
#[derive(Debug)]
pub struct Admitted {
    pub outcome: Standing,
    pub lease: Lease,
    /// Time spent waiting for a route slot.
    pub queued: Duration,
    /// `max_delay`: how long to hold the request before forwarding it (its units are reserved).
    pub hold: Duration,
}

/// The methods an endpoint may name, so that a case variant can be charged (and forwarded) as
/// the method it spells.
const KNOWN_METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

/// `CONNECT` in any case: a request to open a tunnel.
pub fn is_connect(method: &str) -> bool {
    method.eq_ignore_ascii_case("CONNECT")
}

fn canonical_method(method: &str) -> Option<&'static str> {
    if method.bytes().all(|b| !b.is_ascii_lowercase()) {
        return None;
    }
    KNOWN_METHODS
        .iter()
        .find(|m| m.eq_ignore_ascii_case(method))
        .copied()
}

/// Splits a request target into its path and query. Origin-form (`/path?query`) is the only
/// form that is classified as sent; absolute-form (`http://host/path`) is reduced to its
/// origin-form; anything else (`reports/generate`, `*`, an authority) cannot be classified
/// safely.
fn origin_form(target: &str) -> Result<(&str, Option<&str>, bool), BadPath> {
    let (rest, absolute) = if target.starts_with('/') {
        (target, false)
    } else {
        let after_scheme = ["http://", "https://"].iter().find_map(|s| {
            (target.len() >= s.len() && target[..s.len()].eq_ignore_ascii_case(s))
                .then(|| &target[s.len()..])
        });
        let Some(after) = after_scheme else {
            return Err(BadPath::NotAbsolute);
        };
        // The authority ends at the first '/', '?' or '#'.
        let end = after.find(['/', '?', '#']).unwrap_or(after.len());
        let rest = &after[end..];
        if rest.starts_with('#') {
            return Err(BadPath::NotAbsolute);
        }
        (rest, true)
    };
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    // An absolute-form target with an empty path means "/" (RFC 9112 §3.2.2).
    let path = if absolute && path.is_empty() {
        "/"
    } else {
        path
    };
    Ok((path, query, absolute))
}

/// The path of a request target in origin-form or absolute-form (`http://host/path`: the
/// same path, DESIGN §3), None for any other form.
pub fn origin_path(target: &str) -> Option<&str> {
    origin_form(target).ok().map(|(path, _, _)| path)
}

/// Chooses the route from the method and the normalized origin-form target.
pub fn classify(cfg: &Config, method: &str, target: &str) -> Result<Classified, Refusal> {
    let forward_method = canonical_method(method);
    // A tunnel's target is an authority, whatever the request line says; a case variant would
    // be forwarded as `CONNECT`.
    if is_connect(method) {
        return Err(Refusal::new(Problem::BadPath, BadPath::Connect.to_string()));
    }
    let (path, query, absolute) =
        origin_form(target).map_err(|e| Refusal::new(Problem::BadPath, e.to_string()))?;
    let normalized =
        normalize_path(path).map_err(|e| Refusal::new(Problem::BadPath, e.to_string()))?;
    let route = cfg
        .router
        .route_of(forward_method.unwrap_or(method), &normalized)
        .map_err(|e| Refusal::new(Problem::BadPath, e.to_string()))?
        .clone();
    let forward_target = match (normalized, absolute) {
        (Cow::Borrowed(_), false) => None,
        (p, _) => Some(match query {
            Some(q) => format!("{p}?{q}"),
            None => p.into_owned(),
        }),
    };
    Ok(Classified {
        route,
        forward_target,
        forward_method,
    })
}

/// Which identity pays: the request's credentials (two that disagree are refused), else its
/// client address when the config allows anonymous callers.
pub fn identify(
    cfg: &Config,
    headers: &HeaderMap,
    client: Option<IpAddr>,
) -> Result<Identity, Refusal> {
    let key = identity::extract_key(&cfg.sources, headers);
    identity::identify(cfg, key, client).map_err(|e| {
        let detail = match e {
            Unauthenticated::Missing => "an API key is required",
            Unauthenticated::Unknown => "the API key is not known",
            Unauthenticated::Conflicting => "the request carries two different API keys",
        };
        Refusal::new(Problem::Unauthenticated, detail)
    })
}

/// HTTP/1.1 requires `Host` (RFC 9112 §3.2), and a `Host` must be a `uri-host [":" port]`
/// (RFC 9110 §7.2; empty is allowed): a request without one, or with one that is not, is
/// refused before anything is charged (it is copied upstream as `X-Forwarded-Host`).
pub fn require_host(http11: bool, headers: &HeaderMap) -> Result<(), Refusal> {
    match headers.get(http::header::HOST) {
        None if http11 => Err(Refusal::new(
            Problem::BadRequest,
            "an HTTP/1.1 request must carry a Host header",
        )),
        Some(h) if !h.as_bytes().iter().all(|&b| is_authority_byte(b)) => Err(Refusal::new(
            Problem::BadRequest,
            "the Host header is not a host with an optional port",
        )),
        _ => Ok(()),
    }
}

/// A byte a `Host` may hold: a reg-name's, an IP literal's (`[`, `]`, `:`) or a port's (RFC
/// 3986 §3.2.2); no whitespace, and no `@` (`Host` has no userinfo).
fn is_authority_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=:[]".contains(&b)
}

/// Most options a `Connection` header may name: Pingora refuses a request with more as
/// malformed when it forwards it (`MAX_CONNECTION_NOMINATIONS`), after its admission.
const MAX_CONNECTION_OPTIONS: usize = 9;

/// A request whose `Connection` header names more options than it may: refused before it is
/// charged (it was admitted, then failed as malformed, logging an ERROR each time).
pub fn limit_connection_options(headers: &HeaderMap) -> Result<(), Refusal> {
    let n = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter(|t| !t.trim_ascii().is_empty())
        .count();
    if n > MAX_CONNECTION_OPTIONS {
        return Err(Refusal::new(
            Problem::BadRequest,
            format!(
                "the Connection header names {n} options; at most {MAX_CONNECTION_OPTIONS} are accepted"
            ),
        ));
    }
    Ok(())
}

/// A request head Pingora could not parse (it refuses it before any hook, and does not say
/// why): refused as malformed, like a request without `Host`.
pub fn malformed_head() -> Refusal {
    Refusal::new(
        Problem::BadRequest,
        "the request head is not valid HTTP/1.1: its request line, a header field or its \
         message framing (Content-Length, Transfer-Encoding, Host) is malformed or ambiguous",
    )
}

/// The budgets a request is charged besides its key's first: the plan's others, then the
/// route's `shared` budget (always last: [`judge`] tells a shared refusal by that).
pub fn charged_also(route: &Route, who: &Identity) -> Vec<Extra> {
    let mut also = who.policy.also.clone();
    if let Some(shared) = route.shared() {
        also.push(Extra {
            bucket: Bucket::Route(route.label.clone()),
            limit: shared.limit,
        });
    }
    also
}

/// Whether the route's `shared` budget (the last one) is what refused `outcome`.
fn refused_by_shared(route: &Route, outcome: &Standing) -> bool {
    let n = outcome.each.as_slice().len();
    route.shared().is_some() && n > 1 && outcome.each.decisive as usize == n - 1
}

pub use crate::hold::MAX_HELD;

/// The refusal of a request that would be held while [`MAX_HELD`] others are (its
/// reservation is given back by the caller).
pub fn too_many_held(route: &Route, hold: Duration, outcome: Standing) -> Refusal {
    let retry = budget::retry_after_secs(hold.as_micros() as u64);
    Refusal {
        retry_after: Some(retry),
        outcome: Some(outcome),
        reason: Some(if route.shared().is_some() {
            Reason::SharedBudget
        } else {
            Reason::Budget
        }),
        ..Refusal::new(
            Problem::QuotaExceeded,
            format!("{MAX_HELD} requests are already waiting their turn here; retry in {retry} s"),
        )
    }
}

/// A request held for its `max_delay` turn by an instance that exits before it, its
/// reservation given back (`outcome`: the budget as the refund left it).
pub fn exiting_before_turn(route: &Route, outcome: Option<Standing>) -> Refusal {
    Refusal {
        retry_after: Some(1),
        outcome,
        reason: Some(Reason::RouteBusy),
        ..Refusal::new(
            Problem::RouteBusy,
            format!(
                "this gateway instance is shutting down before the turn {} reserved for the \
                 request (max_delay); it was not forwarded and its reservation was given back",
                route.label
            ),
        )
    }
}

/// A request still waiting for a slot (or for its turn before the queue) when its instance
/// exits past its grace period (at SIGINT, at once): it left the queue and its charge was
/// given back; it may go to another instance at once.
pub fn exiting_while_queued(route: &Route, queued: Duration) -> Refusal {
    Refusal {
        retry_after: Some(1),
        reason: Some(Reason::RouteBusy),
        queued,
        waited_for_a_slot: true,
        ..Refusal::new(
            Problem::RouteBusy,
            format!(
                "this gateway instance is shutting down before the request got a slot on {}; \
                 it was not forwarded and its charge was given back",
                route.label
            ),
        )
    }
}

/// The store question for a classified, identified request.
pub fn admit_request(route: &Route, who: &Identity) -> AdmitRequest {
    AdmitRequest {
        key: who.hash,
        limit: who.policy.limit,
        also: charged_also(route, who),
        cost: route.cost,
        key_cap: who.policy.max_in_flight_per_key,
        route: route.label.clone(),
        route_cap: route.max_in_flight,
        // A shadow route never waits for a slot: shadow mode must not add latency, so a full
        // cap is counted at once (as the refusal enforcement would make after its queue).
        queue_timeout: if route.fidelity.shadow {
            Duration::ZERO
        } else {
            route.queue_timeout
        },
        fair: Fair {
            weight: who.policy.weight,
            per_key: route.queue.per_key,
            max_queue: route.queue.max_queue,
            since: route.loaded_ms,
        },
    }
}

/// Turns the store's answer into an admission or a refusal a client can act on.
pub fn judge(route: &Route, admission: Admission) -> Result<Admitted, Refusal> {
    match admission {
        Admission::Admitted {
            standing,
            delay_us,
            lease,
            queued,
        } => Ok(Admitted {
            outcome: standing,
            lease,
            queued,
            // A shadow route is never held for its turn: it adds no latency (charged as
            // enforcement would charge it).
            hold: match route.fidelity.shadow {
                true => Duration::ZERO,
                false => Duration::from_micros(delay_us),
            },
        }),
        Admission::NotHeld {
            standing,
            hold_us,
            exiting,
        } => Err(match exiting {
            true => exiting_before_turn(route, Some(standing)),
            false => too_many_held(route, Duration::from_micros(hold_us), standing),
        }),
        Admission::OverBudget {
            standing,
            retry_after_us,
        } => Err(over_budget(route, standing, retry_after_us)),
        Admission::KeyBusy(outcome) => Err(Refusal {
            retry_after: Some(1),
            outcome: Some(outcome),
            ..Refusal::new(
                Problem::ConcurrencyLimit,
                "this key has as many requests in flight as its plan allows",
            )
        }),
        Admission::RouteBusy {
            standing,
            queued,
            full,
        } => Err(route_busy(route, standing, queued, full)),
        Admission::Unavailable => Err(Refusal {
            retry_after: Some(1),
            ..Refusal::new(
                Problem::StoreUnavailable,
                "the rate-limit store is unavailable",
            )
        }),
    }
}

/// A budget that cannot fit the request within `max_delay`: the route's shared one, or the
/// key's.
fn over_budget(route: &Route, outcome: Standing, retry_after_us: u64) -> Refusal {
    let retry = budget::retry_after_secs(retry_after_us);
    if refused_by_shared(route, &outcome) {
        return Refusal {
            retry_after: Some(retry),
            outcome: Some(outcome),
            reason: Some(Reason::SharedBudget),
            ..Refusal::new(
                Problem::QuotaExceeded,
                format!(
                    "{} is shared by all callers and its turn is more than max_delay away; retry in {retry} s",
                    route.label
                ),
            )
        };
    }
    Refusal {
        retry_after: Some(retry),
        outcome: Some(outcome),
        ..Refusal::new(
            Problem::QuotaExceeded,
            format!(
                "this request costs {} units and {} are left; retry in {retry} s",
                route.cost,
                // As `remaining` and `X-RateLimit-Remaining` say: the tightest budget's.
                outcome.shown().1.remaining
            ),
        )
    }
}

/// As [`judge`], for a job's submission: a job waits for its slot up to its `result_ttl`,
/// whatever the route's `queue_timeout`, so a route with no place for it had its queue full.
pub fn judge_job(route: &Route, admission: Admission) -> Result<Admitted, Refusal> {
    match admission {
        Admission::RouteBusy {
            standing, queued, ..
        } => Err(route_busy(route, standing, queued, true)),
        other => judge(route, other),
    }
}

/// A capped route that had no slot for the request; `full`: its queue held `max_queue`
/// waiters.
fn route_busy(route: &Route, outcome: Standing, queued: Duration, full: bool) -> Refusal {
    Refusal {
        retry_after: Some(1),
        outcome: Some(outcome),
        queued,
        waited_for_a_slot: !route.queue_timeout.is_zero() && !full,
        // A full route with no queue is refused at once (`in_flight`); `route_busy` is a
        // full queue, or a full route that stayed full for its queue_timeout.
        reason: Some(if route.queue_timeout.is_zero() && !full {
            Reason::InFlight
        } else {
            Reason::RouteBusy
        }),
        ..Refusal::new(Problem::RouteBusy, route_busy_detail(route, full, queued))
    }
}

/// Why a capped route refused: its queue was full (refused at once), or no slot came free
/// in time — the route's or, with `max_in_flight_per_key`, the key's share of it — within
/// its `queue_timeout`, or in the time it `queued` when it could wait no longer (its place
/// lost to a stall of its instance). Says what the route allows: how many run is the
/// store's to know (after a failover it may be more).
fn route_busy_detail(route: &Route, full: bool, queued: Duration) -> String {
    let cap = route.max_in_flight.unwrap_or(0);
    let mut allows = format!(
        "{} allows {cap} request{} in flight",
        route.label,
        if cap == 1 { "" } else { "s" }
    );
    if let Some(share) = route.queue.per_key {
        allows.push_str(&format!(", {share} per key"));
    }
    match route.queue.max_queue {
        Some(max) if full => {
            format!("{allows} and its queue already holds {max} waiting (max_queue)")
        }
        _ => format!(
            "{allows}; no slot freed {}within {} ms",
            if route.queue.per_key.is_some() {
                "for this key "
            } else {
                ""
            },
            route
                .queue_timeout
                .min(queued.max(Duration::from_millis(1)))
                .as_millis()
        ),
    }
}

/// The refusals `mode: shadow` forwards instead, by their reason: the rate limiter's own
/// decisions ([`Reason::shadowable`]).
pub fn shadowed(route: &Route, r: &Refusal) -> Option<Reason> {
    if !route.fidelity.shadow {
        return None;
    }
    r.reason.filter(|reason| reason.shadowable())
}

/// The answer to a request the upstream never answered (connect failure or timeout); the
/// request's charge is given back before this is sent.
pub fn upstream_failed(failure: UpstreamFailure) -> Refusal {
    match failure {
        UpstreamFailure::TimedOut => Refusal::new(
            Problem::GatewayTimeout,
            "the upstream did not answer in time; it had the request, so the request is charged",
        ),
        UpstreamFailure::HungUp => Refusal::new(
            Problem::BadGateway,
            "the upstream closed the connection without answering; it had the request, so the request is charged",
        ),
        UpstreamFailure::CutOff => Refusal::new(
            Problem::BadGateway,
            "this gateway instance exited past its grace period while the upstream worked on the request; it had the request, so the request is charged",
        ),
        UpstreamFailure::Malformed => Refusal::new(
            Problem::BadGateway,
            "the upstream's answer could not be read (it is not valid HTTP); it had the request, so the request is charged",
        ),
        UpstreamFailure::Unreachable => Refusal::new(
            Problem::BadGateway,
            "the upstream could not be reached; the request was not charged",
        ),
    }
}

/// How the upstream failed a request it did not answer (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// It never had the request (`upstreams::had_request`): 502, refunded.
    Unreachable,
    /// It had the request and closed the connection without an answer: 502, charged.
    HungUp,
    /// It had the request when the instance, exiting past its grace period (or at SIGINT),
    /// cut the request off (`Drain::cut_off`): 502, charged.
    CutOff,
    /// It had the request and answered with something that is not HTTP (an invalid head):
    /// 502, charged.
    Malformed,
    /// It had the request and did not answer within `read_timeout`: 504, charged.
    TimedOut,
}

#[cfg(test)]
mod tests;
