//! What a consumer reads on a refusal: RFC 9457 problem JSON, and the rate-limit headers of
//! DESIGN §3 (IETF draft-ietf-httpapi-ratelimit-headers plus the de-facto `X-RateLimit-*`).

use crate::budget;
use crate::reason::Reason;
use crate::store::Standing;
use http::HeaderValue;

use crate::policy::{Budget, Policy};

/// Base of every problem `type` URI; the last segment is what clients match on.
pub const TYPE_BASE: &str = "https://tollgate.dev/problems/";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    QuotaExceeded,
    ConcurrencyLimit,
    RouteBusy,
    StoreUnavailable,
    Unauthenticated,
    BadPath,
    /// A request that is malformed in some other way (HTTP/1.1 without `Host`).
    BadRequest,
    /// The request body stalled past `server.body_timeout`.
    RequestTimeout,
    BadGateway,
    GatewayTimeout,
    /// An async request's body over `async.max_request_body` (not charged).
    PayloadTooLarge,
    /// A job whose running instance died: the upstream had it (charged, never re-run).
    JobLost,
    /// A job whose upstream answer was over `async.max_response_body` (charged).
    JobResponseTooLarge,
    /// No such job for this key (or its result expired).
    JobNotFound,
    /// A job that already runs (or ran) cannot be cancelled.
    JobStarted,
}

impl Problem {
    pub fn status(self) -> u16 {
        match self {
            Problem::QuotaExceeded | Problem::ConcurrencyLimit => 429,
            Problem::RouteBusy | Problem::StoreUnavailable => 503,
            Problem::Unauthenticated => 401,
            Problem::BadPath | Problem::BadRequest => 400,
            Problem::RequestTimeout => 408,
            Problem::BadGateway => 502,
            Problem::GatewayTimeout => 504,
            Problem::PayloadTooLarge => 413,
            Problem::JobLost | Problem::JobResponseTooLarge => 502,
            Problem::JobNotFound => 404,
            Problem::JobStarted => 409,
        }
    }

    pub fn slug(self) -> &'static str {
        match self {
            Problem::QuotaExceeded => "quota-exceeded",
            Problem::ConcurrencyLimit => "concurrency-limit",
            Problem::RouteBusy => "route-busy",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::Unauthenticated => "unauthenticated",
            Problem::BadPath => "bad-path",
            Problem::BadRequest => "bad-request",
            Problem::RequestTimeout => "request-timeout",
            Problem::BadGateway => "upstream-unavailable",
            Problem::GatewayTimeout => "upstream-timeout",
            Problem::PayloadTooLarge => "payload-too-large",
            Problem::JobLost => "job-lost",
            Problem::JobResponseTooLarge => "response-too-large",
            Problem::JobNotFound => "job-not-found",
            Problem::JobStarted => "job-started",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Problem::QuotaExceeded => "Rate limit budget exceeded",
            Problem::ConcurrencyLimit => "Too many concurrent requests for this key",
            Problem::RouteBusy => "Route is at its concurrency limit",
            Problem::StoreUnavailable => "Rate limit store unavailable",
            Problem::Unauthenticated => "Missing or unknown API key",
            Problem::BadPath => "Path cannot be classified",
            Problem::BadRequest => "Malformed request",
            Problem::RequestTimeout => "Request body timed out",
            Problem::BadGateway => "Upstream unavailable",
            Problem::GatewayTimeout => "Upstream timed out",
            Problem::PayloadTooLarge => "Request body too large for a job",
            Problem::JobLost => "The instance running the job was lost",
            Problem::JobResponseTooLarge => "Upstream answer too large to keep",
            Problem::JobNotFound => "No such job",
            Problem::JobStarted => "The job has already started",
        }
    }

    /// The rejection reason of `tollgate_rejections_total`, for gateway refusals.
    pub fn reason(self) -> Option<Reason> {
        match self {
            Problem::QuotaExceeded => Some(Reason::Budget),
            Problem::ConcurrencyLimit => Some(Reason::KeyInFlight),
            // `in_flight` instead when the route has no queue (decided where that is known).
            Problem::RouteBusy => Some(Reason::RouteBusy),
            Problem::StoreUnavailable => Some(Reason::StoreUnavailable),
            Problem::Unauthenticated => Some(Reason::Unauthenticated),
            Problem::BadPath => Some(Reason::BadPath),
            Problem::BadRequest => Some(Reason::BadRequest),
            Problem::PayloadTooLarge => Some(Reason::PayloadTooLarge),
            Problem::RequestTimeout
            | Problem::BadGateway
            | Problem::GatewayTimeout
            | Problem::JobLost
            | Problem::JobResponseTooLarge
            | Problem::JobNotFound
            | Problem::JobStarted => None,
        }
    }
}

/// The body of a problem response.
pub fn body(
    p: Problem,
    detail: &str,
    cost: Option<u64>,
    remaining: Option<u64>,
    retry_after: Option<u64>,
) -> Vec<u8> {
    let mut v = serde_json::json!({
        "type": format!("{TYPE_BASE}{}", p.slug()),
        "title": p.title(),
        "status": p.status(),
        "detail": detail,
    });
    if let Some(map) = v.as_object_mut() {
        if let Some(c) = cost {
            map.insert("cost".into(), c.into());
        }
        if let Some(r) = remaining {
            map.insert("remaining".into(), r.into());
        }
        if let Some(r) = retry_after {
            map.insert("retry_after".into(), r.into());
        }
    }
    serde_json::to_vec(&v).unwrap_or_default()
}

/// The names of [`rate_limit_headers`]' headers, in its order, parsed once: for looking them
/// up in a response (`http` parses a `&str` name on every lookup).
pub const RATE_LIMIT_NAMES: [http::HeaderName; 6] = [
    http::HeaderName::from_static("ratelimit-policy"),
    http::HeaderName::from_static("ratelimit"),
    http::HeaderName::from_static("x-ratelimit-limit"),
    http::HeaderName::from_static("x-ratelimit-remaining"),
    http::HeaderName::from_static("x-ratelimit-reset"),
    http::HeaderName::from_static("x-ratelimit-cost"),
];

/// Whether `name` is one of [`RATE_LIMIT_NAMES`]: a prefix test first, which almost every
/// upstream header fails, so a response is scanned once instead of hashed six times.
pub fn is_rate_limit_name(name: &http::HeaderName) -> bool {
    let s = name.as_str();
    (s.starts_with("ratelimit") || s.starts_with("x-ratelimit-")) && RATE_LIMIT_NAMES.contains(name)
}

/// One `RateLimit` list member, `<name>;r=<remaining>;t=<reset>`, appended to `out`. Once
/// per request, so without the formatting machinery.
fn push_member(out: &mut String, quoted_name: &str, remaining: u64, reset: u64) {
    out.push_str(quoted_name);
    out.push_str(";r=");
    out.push_str(itoa::Buffer::new().format(remaining));
    out.push_str(";t=");
    out.push_str(itoa::Buffer::new().format(reset));
}

/// `RateLimit-Policy`: the key's plan's budgets, and the route's shared budget after them.
pub fn policy_header(policy: &Policy, shared: Option<&Budget>) -> HeaderValue {
    match (shared, policy.headers.policy.to_str()) {
        (Some(s), Ok(list)) => {
            let both = format!("{list}, {}", s.headers.policy.to_str().unwrap_or_default());
            HeaderValue::from_str(&both).unwrap_or_else(|_| policy.headers.policy.clone())
        }
        _ => policy.headers.policy.clone(),
    }
}

/// `RateLimit-Policy`, `RateLimit` and `X-RateLimit-*` for a decision under `policy`.
/// `cost` is the price of the request (charged when admitted, nothing when refused). The
/// policy's own two values are formatted once, when the config is loaded. A decision made on
/// `1/share` of every budget (the `local` fallback) is described by those shares: every
/// figure of the headers is of the budget that decided.
pub fn rate_limit_headers(
    policy: &Policy,
    shared: Option<&Budget>,
    outcome: &Standing,
    cost: u64,
    share: u32,
) -> [(&'static str, HeaderValue); 6] {
    if share > 1 {
        let local = policy.share(share);
        let shared = shared.map(|b| b.share(share));
        return rate_limit_headers(&local, shared.as_ref(), outcome, cost, 1);
    }
    let figures = outcome.each.as_slice();
    let budgets = || policy.budgets.iter().chain(shared);
    let several = figures.len() > 1 && figures.len() == budgets().count();
    // One list member per budget when the request was decided on several; `X-RateLimit-*`
    // describe the tightest (`Standing::shown`).
    let (shown_i, shown) = match several {
        true => outcome.shown(),
        false => (
            0,
            budget::Figure {
                remaining: outcome.remaining,
                reset_us: outcome.reset_us,
            },
        ),
    };
    let reset = budget::reset_secs(shown.reset_us);
    let policy_header = policy_header(policy, shared);
    let mut rate_limit = String::with_capacity(64);
    let limit = if several {
        for (i, (b, f)) in budgets().zip(figures).enumerate() {
            if i > 0 {
                rate_limit.push_str(", ");
            }
            let reset = budget::reset_secs(f.reset_us);
            push_member(&mut rate_limit, &b.headers.quoted_name, f.remaining, reset);
        }
        budgets()
            .nth(shown_i)
            .map_or(policy.headers.limit.clone(), |b| b.headers.limit.clone())
    } else {
        let name = &policy.headers.quoted_name;
        push_member(&mut rate_limit, name, shown.remaining, reset);
        policy.headers.limit.clone()
    };
    [
        ("RateLimit-Policy", policy_header),
        (
            "RateLimit",
            HeaderValue::from_maybe_shared(bytes::Bytes::from(rate_limit))
                .unwrap_or_else(|_| HeaderValue::from_static("")),
        ),
        ("X-RateLimit-Limit", limit),
        ("X-RateLimit-Remaining", HeaderValue::from(shown.remaining)),
        ("X-RateLimit-Reset", HeaderValue::from(reset)),
        ("X-RateLimit-Cost", HeaderValue::from(cost)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Limit;
    use std::time::Duration;

    #[test]
    fn headers_syntax() {
        let w = Duration::from_secs(60);
        let limit = Limit::new(120, w, Duration::ZERO).unwrap();
        let policy =
            Policy::new("default", vec![(None, 120, w, limit)], Duration::ZERO, None).unwrap();
        let o = Standing {
            remaining: 40,
            reset_us: 39_000_001,
            each: Default::default(),
        };
        let h = rate_limit_headers(&policy, None, &o, 20, 1);
        assert_eq!(h[0].0, "RateLimit-Policy");
        assert_eq!(h[0].1, "\"default\";q=120;w=60");
        assert_eq!(h[1].0, "RateLimit");
        assert_eq!(h[1].1, "\"default\";r=40;t=40");
        assert_eq!(h[2].1, "120");
        assert_eq!(h[3].1, "40");
        assert_eq!(h[4].1, "40");
        assert_eq!(h[5].1, "20");
        // The parsed names that responses are searched by are the same headers, in order.
        for ((name, _), parsed) in h.iter().zip(&RATE_LIMIT_NAMES) {
            assert_eq!(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                parsed
            );
        }
        for name in &RATE_LIMIT_NAMES {
            assert!(is_rate_limit_name(name), "{name}");
        }
        for other in [
            "ratelimit-foo",
            "x-ratelimit-used",
            "x-ratelimit",
            "retry-after",
            "rate",
        ] {
            let name = http::HeaderName::from_static(other);
            assert!(!is_rate_limit_name(&name), "{other}");
        }
    }

    #[test]
    fn headers_of_several_budgets() {
        let policy = crate::policy::minute_and_day(120, 20_000);
        let o = crate::budget::decide_all(
            &[
                (policy.budgets[0].limit, None),
                (policy.budgets[1].limit, None),
            ],
            0,
            20,
        )
        .outcome;
        let h = rate_limit_headers(&policy, None, &(&o).into(), 20, 1);
        assert_eq!(
            h[0].1,
            "\"pro-minute\";q=120;w=60, \"pro-day\";q=20000;w=86400"
        );
        assert_eq!(
            h[1].1,
            "\"pro-minute\";r=100;t=10, \"pro-day\";r=19980;t=87"
        );
        assert_eq!(
            (h[2].1.to_str().unwrap(), h[3].1.to_str().unwrap()),
            ("120", "100")
        );
    }

    /// On the local fallback of a fleet of 2 (a share of every budget, the route's shared
    /// one too), every figure is of the shares.
    #[test]
    fn headers_of_a_local_share() {
        let policy = crate::policy::minute_and_day(120, 20_000);
        let shared = crate::policy::Budget::new(
            crate::policy::SHARED_BUDGET,
            10,
            Duration::from_secs(1),
            Limit::new(10, Duration::from_secs(1), Duration::ZERO).unwrap(),
        );
        let limits: Vec<_> = [&policy.budgets[0], &policy.budgets[1], &shared]
            .iter()
            .map(|b| (b.limit.fraction(2), None))
            .collect();
        let o = crate::budget::decide_all(&limits, 0, 1).outcome;
        let h = rate_limit_headers(&policy, Some(&shared), &(&o).into(), 1, 2);
        assert_eq!(
            h[0].1,
            "\"pro-minute\";q=60;w=60, \"pro-day\";q=10000;w=86400, \"shared\";q=5;w=1"
        );
        assert_eq!(
            h[1].1,
            "\"pro-minute\";r=59;t=1, \"pro-day\";r=9999;t=9, \"shared\";r=4;t=1"
        );
        // The tightest is the shared budget's share: 4 of 5.
        assert_eq!(
            (h[2].1.to_str().unwrap(), h[3].1.to_str().unwrap()),
            ("5", "4")
        );
    }

    #[test]
    fn problem_body() {
        let b = body(Problem::QuotaExceeded, "over", Some(20), Some(0), Some(10));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["type"], "https://tollgate.dev/problems/quota-exceeded");
        assert_eq!(v["status"], 429);
        assert_eq!(v["cost"], 20);
        assert_eq!(v["remaining"], 0);
        assert_eq!(v["retry_after"], 10);
        let b = body(Problem::BadPath, "x", None, None, None);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert!(v.get("cost").is_none());
        assert_eq!(v["status"], 400);
    }
}
