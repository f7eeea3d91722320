use super::*;
use crate::config::EnvOverrides;
use crate::store::Admission;

fn cfg(extra: &str) -> Config {
    let y = format!(
        "upstream: {{url: \"http://127.0.0.1:1\"}}\nrate_limits:\n  default: {{window: 60s, max_cost: 120}}\n  endpoints:\n    /reports/generate: {{cost: 20, max_in_flight: 5}}\n    /exports/bulk: {{cost: 15, max_in_flight: 2, queue_timeout: 1s}}\n    \"DELETE /items/{{id}}\": {{cost: 3}}\n{extra}"
    );
    Config::parse(&y, &EnvOverrides::default()).unwrap()
}

fn label(c: &Config, method: &str, target: &str) -> String {
    classify(c, method, target).unwrap().route.label.to_string()
}

#[test]
fn target_forms() {
    let c = cfg("");
    assert_eq!(label(&c, "POST", "/reports/generate"), "/reports/generate");
    assert_eq!(
        classify(&c, "POST", "/reports/generate?x=1")
            .unwrap()
            .forward_target,
        None
    );
    // Absolute-form is charged by its path and forwarded as origin-form.
    let abs = classify(&c, "POST", "http://api.example/reports//generate?a=b").unwrap();
    assert_eq!(&*abs.route.label, "/reports/generate");
    assert_eq!(abs.forward_target.as_deref(), Some("/reports/generate?a=b"));
    let abs = classify(&c, "GET", "HTTPS://h:8080").unwrap();
    assert_eq!(abs.forward_target.as_deref(), Some("/"));
    // Anything else never reaches the default route.
    for t in [
        "reports/generate",
        "*",
        "api.example:443",
        "",
        "ftp://h/reports/generate",
    ] {
        let r = classify(&c, "POST", t).unwrap_err();
        assert_eq!(r.problem, Problem::BadPath, "{t}");
        assert_eq!(r.reason, Some(Reason::BadPath));
    }
}

#[test]
fn normalization_is_forwarded() {
    let c = cfg("");
    let n = classify(&c, "POST", "/x/../reports/%67enerate?q=%2F").unwrap();
    assert_eq!(&*n.route.label, "/reports/generate");
    assert_eq!(n.forward_target.as_deref(), Some("/reports/generate?q=%2F"));
    assert_eq!(
        classify(&c, "GET", "/a%2Fb").unwrap_err().problem,
        Problem::BadPath
    );
}

#[test]
fn method_case_is_charged_as_the_method() {
    let c = cfg("");
    let d = classify(&c, "delete", "/items/7").unwrap();
    assert_eq!(&*d.route.label, "DELETE /items/{id}");
    assert_eq!(d.forward_method, Some("DELETE"));
    assert_eq!(
        classify(&c, "DELETE", "/items/7").unwrap().forward_method,
        None
    );
    assert_eq!(label(&c, "dElEtE", "/items/7"), "DELETE /items/{id}");
    // An extension method stays what it is.
    let m = classify(&c, "purge", "/items/7").unwrap();
    assert_eq!((&*m.route.label, m.forward_method), ("default", None));
}

#[test]
fn host_is_required_on_http11() {
    let mut h = HeaderMap::new();
    assert_eq!(
        require_host(true, &h).unwrap_err().problem,
        Problem::BadRequest
    );
    assert!(require_host(false, &h).is_ok());
    h.insert("host", "x".parse().unwrap());
    assert!(require_host(true, &h).is_ok());
    // A host with a port, an IP literal, an empty one (RFC 9110 §7.2): accepted; one with a
    // space, a slash or userinfo is not a host, on HTTP/1.0 too.
    for ok in [
        "api.example.com:8080",
        "127.0.0.1",
        "[::1]:80",
        "xn--bcher-kva.example",
        "",
    ] {
        h.insert("host", ok.parse().unwrap());
        assert!(require_host(true, &h).is_ok(), "{ok:?}");
    }
    for bad in ["a b", "a/b", "user@host", "host\tx", "h\u{e9}"] {
        h.insert(
            "host",
            http::HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
        );
        for http11 in [true, false] {
            let e = require_host(http11, &h).unwrap_err();
            assert_eq!(e.problem, Problem::BadRequest, "{bad:?}");
        }
    }
}

#[test]
fn conflicting_credentials_are_refused() {
    let c = cfg("");
    let mut h = HeaderMap::new();
    h.append("x-api-key", "k1".parse().unwrap());
    h.append("authorization", "Bearer k1".parse().unwrap());
    assert!(identify(&c, &h, None).is_ok());
    h.append("x-api-key", "k2".parse().unwrap());
    let r = identify(&c, &h, None).unwrap_err();
    assert_eq!(r.problem, Problem::Unauthenticated);
    assert_eq!(r.reason, Some(Reason::Unauthenticated));
}

#[test]
fn client_ip_namespace_is_unreachable_by_keys() {
    let c = cfg("identity: {anonymous: client_ip}\n");
    let ip: IpAddr = "127.0.0.1".parse().unwrap();
    let anon = identify(&c, &HeaderMap::new(), Some(ip)).unwrap();
    for key in ["127.0.0.1", "ip:127.0.0.1"] {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", key.parse().unwrap());
        assert_ne!(identify(&c, &h, Some(ip)).unwrap().hash, anon.hash, "{key}");
    }
}

fn standing(remaining: u64) -> Standing {
    Standing {
        remaining,
        reset_us: 0,
        each: Default::default(),
    }
}

#[test]
fn store_answers_become_refusals() {
    let c = cfg("");
    let reports = classify(&c, "POST", "/reports/generate").unwrap().route;
    let exports = classify(&c, "POST", "/exports/bulk").unwrap().route;

    let over = judge(
        &reports,
        Admission::OverBudget {
            standing: standing(3),
            retry_after_us: 9_000_001,
        },
    )
    .unwrap_err();
    assert_eq!(
        (over.problem, over.retry_after, over.reason),
        (Problem::QuotaExceeded, Some(10), Some(Reason::Budget))
    );
    assert_eq!(
        over.detail,
        "this request costs 20 units and 3 are left; retry in 10 s"
    );

    let busy = |route: &Route| {
        judge(
            route,
            Admission::RouteBusy {
                standing: standing(1),
                queued: Duration::from_millis(5),
                full: false,
            },
        )
        .unwrap_err()
    };
    assert_eq!(busy(&reports).reason, Some(Reason::InFlight));
    let b = busy(&exports);
    assert_eq!(
        (b.problem, b.reason, b.retry_after, b.queued),
        (
            Problem::RouteBusy,
            Some(Reason::RouteBusy),
            Some(1),
            Duration::from_millis(5)
        )
    );

    let key = judge(&reports, Admission::KeyBusy(standing(1))).unwrap_err();
    assert_eq!(
        (key.problem, key.reason, key.retry_after),
        (
            Problem::ConcurrencyLimit,
            Some(Reason::KeyInFlight),
            Some(1)
        )
    );

    let down = judge(&reports, Admission::Unavailable).unwrap_err();
    assert_eq!(
        (down.problem, down.reason, down.outcome),
        (
            Problem::StoreUnavailable,
            Some(Reason::StoreUnavailable),
            None
        )
    );

    let ok = judge(
        &reports,
        Admission::Admitted {
            standing: standing(100),
            delay_us: 1_500,
            lease: Lease::default(),
            queued: Duration::ZERO,
        },
    )
    .unwrap();
    assert_eq!(ok.hold, Duration::from_micros(1_500));

    // A capped request the store could not hold for its turn before the route's queue: past
    // the bound as when the proxy holds it (429, retry at its turn), or the instance exits.
    let not_held = |exiting| {
        judge(
            &reports,
            Admission::NotHeld {
                standing: standing(0),
                hold_us: 4_200_000,
                exiting,
            },
        )
        .unwrap_err()
    };
    let full = not_held(false);
    assert_eq!(
        (full.problem, full.reason, full.retry_after),
        (Problem::QuotaExceeded, Some(Reason::Budget), Some(5))
    );
    assert!(full.detail.contains("1024 requests"), "{}", full.detail);
    let exiting = not_held(true);
    assert_eq!(
        (exiting.problem, exiting.reason, exiting.retry_after),
        (Problem::RouteBusy, Some(Reason::RouteBusy), Some(1))
    );
    assert!(
        exiting.detail.contains("shutting down"),
        "{}",
        exiting.detail
    );
}

/// A queue that was full says so only when the store says it was: a request that waited
/// its queue_timeout less its calls to Redis is a timed-out one, however little short of
/// the queue_timeout its wait was (it was told its queue held max_queue waiting, and its
/// wait went uncounted).
#[test]
fn a_full_queue_is_the_stores_word_not_a_short_wait() {
    let c = cfg("    /q: {cost: 1, max_in_flight: 1, queue_timeout: 1s, max_queue: 4}\n");
    let q = classify(&c, "POST", "/q").unwrap().route;
    let busy = |queued: u64, full: bool| {
        judge(
            &q,
            Admission::RouteBusy {
                standing: standing(1),
                queued: Duration::from_millis(queued),
                full,
            },
        )
        .unwrap_err()
    };
    let timed_out = busy(997, false);
    assert_eq!(
        timed_out.detail,
        "/q allows 1 request in flight; no slot freed within 997 ms"
    );
    assert!(timed_out.waited_for_a_slot);
    let full = busy(0, true);
    assert_eq!(
        full.detail,
        "/q allows 1 request in flight and its queue already holds 4 waiting (max_queue)"
    );
    assert!(!full.waited_for_a_slot);
    assert_eq!(full.reason, Some(Reason::RouteBusy));
}

#[test]
fn shadow_mode_forwards_only_the_limiter_refusals() {
    let c = cfg("");
    let enforced = classify(&c, "POST", "/reports/generate").unwrap().route;
    let c = cfg("  mode: shadow\n");
    let shadow = classify(&c, "POST", "/exports/bulk").unwrap().route;
    let over = judge(
        &shadow,
        Admission::OverBudget {
            standing: standing(0),
            retry_after_us: 1,
        },
    )
    .unwrap_err();
    assert_eq!(shadowed(&shadow, &over), Some(Reason::Budget));
    assert_eq!(shadowed(&enforced, &over), None);
    let unauth = Refusal::new(Problem::Unauthenticated, "x");
    assert_eq!(shadowed(&shadow, &unauth), None);
    let down = judge(&shadow, Admission::Unavailable).unwrap_err();
    assert_eq!(shadowed(&shadow, &down), Some(Reason::StoreUnavailable));
    // A shared budget's refusals and the bound on held requests are the limiter's too.
    let shared = Refusal {
        reason: Some(Reason::SharedBudget),
        ..over.clone()
    };
    assert_eq!(shadowed(&shadow, &shared), Some(Reason::SharedBudget));
    let held = too_many_held(&shadow, Duration::from_secs(2), standing(0));
    assert_eq!(shadowed(&shadow, &held), Some(Reason::Budget));
    // A shadow route never queues for a slot; an enforced one does.
    let who = identify(
        &c,
        &HeaderMap::from_iter([("x-api-key".parse().unwrap(), "k".parse().unwrap())]),
        None,
    )
    .unwrap();
    assert_eq!(admit_request(&shadow, &who).queue_timeout, Duration::ZERO);
    let c = cfg("");
    let exports = classify(&c, "POST", "/exports/bulk").unwrap().route;
    assert_eq!(
        admit_request(&exports, &who).queue_timeout,
        Duration::from_secs(1)
    );
}

#[test]
fn upstream_failures_are_not_gateway_refusals() {
    use UpstreamFailure::*;
    assert_eq!(upstream_failed(TimedOut).problem, Problem::GatewayTimeout);
    for f in [Unreachable, HungUp, CutOff, Malformed] {
        assert_eq!(upstream_failed(f).problem, Problem::BadGateway);
        assert_eq!(upstream_failed(f).reason, None);
    }
}

#[test]
fn shared_budget_refusals_and_the_hold_bound() {
    let c = Config::parse(
        "upstream: {url: \"http://127.0.0.1:1\"}\nrate_limits:\n  default: {window: 60s, max_cost: 120}\n  endpoints:\n    \"/p/{*rest}\": {shared: {max_cost: 1, window: 500ms, max_delay: 30s}}\n",
        &crate::config::EnvOverrides::default(),
    )
    .unwrap();
    let route = classify(&c, "GET", "/p/x").unwrap().route;
    let who = identify(
        &c,
        &HeaderMap::from_iter([("x-api-key".parse().unwrap(), "k".parse().unwrap())]),
        None,
    )
    .unwrap();
    let req = admit_request(&route, &who);
    assert_eq!(
        req.also.len(),
        1,
        "the key's budget and the route's shared one"
    );
    // Refused by the last budget (the shared one): reason shared_budget.
    let joint = budget::decide_all(
        &[
            (req.limit, None),
            (
                req.also[0].limit,
                Some(budget::State::of(&req.also[0].limit, u64::MAX / 4, 0)),
            ),
        ],
        0,
        1,
    );
    assert_eq!(joint.outcome.each.decisive, 1);
    let r = judge(&route, Admission::over_budget(&joint.outcome)).unwrap_err();
    assert_eq!(
        (r.problem, r.reason),
        (Problem::QuotaExceeded, Some(Reason::SharedBudget))
    );
    // Past the bound on held requests: 429, Retry-After from the hold.
    let r = too_many_held(
        &route,
        Duration::from_millis(1_500),
        (&joint.outcome).into(),
    );
    assert_eq!(r.problem.status(), 429);
    assert_eq!(
        (r.retry_after, r.reason),
        (Some(2), Some(Reason::SharedBudget))
    );
}
