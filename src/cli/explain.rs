//! `tollgate explain`'s text: which route a request is charged as, what it costs, and which
//! limits apply to it and to the key that pays.

use std::fmt::Write;
use std::time::Duration;

use crate::config::{format_duration, Config};
use crate::decision;
use crate::identity::{self, Identity, Unauthenticated};
use crate::route::Route;

/// `tollgate explain`: which route, what cost, which limits. Returns the text and whether the
/// request would be classified at all.
pub fn explain(cfg: &Config, method: &str, path: &str, key: Option<&str>) -> (String, bool) {
    let mut out = String::new();
    // What the proxy's HTTP parser does before the gateway sees a request: a method that is
    // not a token is a 400, and a fragment (`#…`, which clients do not send) is dropped.
    if http::Method::from_bytes(method.as_bytes()).is_err() {
        let _ = writeln!(
            out,
            "{method:?} {path}: 400 (not an HTTP method: the request is refused before it is classified)"
        );
        return (out, false);
    }
    let path = path.split_once('#').map_or(path, |(p, _)| p);
    // A path the gateway keeps for jobs is answered by it, whatever the routes (DESIGN §8).
    if !decision::is_connect(method) {
        if let Some(id) = crate::proxy::job_in(path.as_bytes()) {
            explain_job(&mut out, cfg, method, path, &id, key);
            return (out, true);
        }
    }
    // The proxy's own classification, so that explain and the gateway never disagree.
    let classified = match decision::classify(cfg, method, path) {
        Ok(c) => c,
        Err(r) => {
            let _ = writeln!(
                out,
                "{method} {path}: {} {} ({})",
                r.problem.status(),
                r.problem.slug(),
                r.detail
            );
            return (out, false);
        }
    };
    let route = &classified.route;
    let method = classified.forward_method.unwrap_or(method);
    let _ = writeln!(out, "request:      {method} {path}");
    if let Some(t) = &classified.forward_target {
        let _ = writeln!(out, "normalized:   {t}  (what the upstream receives)");
    }
    let _ = writeln!(out, "route:        {}", route.label);
    explain_cost(&mut out, route);
    explain_route(&mut out, route);
    let who = identity::identify(cfg, Ok(key.map(str::as_bytes)), Some([127, 0, 0, 1].into()));
    match who {
        Ok(id) => explain_key(&mut out, route, &id, key.is_some()),
        Err(e) => {
            let _ = writeln!(out, "key:          {}", refused(e));
        }
    }
    (out, true)
}

/// `explain` of a request about a job (`/_tollgate/jobs/<id>`): the gateway answers it from
/// the job board, for the key that submitted the job only; never forwarded, never charged.
fn explain_job(
    out: &mut String,
    cfg: &Config,
    method: &str,
    path: &str,
    id: &str,
    key: Option<&str>,
) {
    // As the proxy reads it: the method in any case, and a job this key does not have is
    // 404 whatever the method.
    let what = match method.to_ascii_uppercase().as_str() {
        "GET" | "HEAD" => "the job's status, then its result (202 while it waits or runs)",
        "DELETE" => "cancels the job if it has not started (409 job-started once it has)",
        _ => "405 for a job of this key (a job answers GET, HEAD and DELETE)",
    };
    let _ = writeln!(out, "request:      {method} {path}");
    let _ = writeln!(
        out,
        "job:          {}",
        if id.is_empty() { "(no id: 404)" } else { id }
    );
    let _ = writeln!(out, "answered by:  the gateway, never forwarded: {what}");
    let _ = writeln!(out, "cost:         0 (never charged, takes no slot)");
    let who = identity::identify(cfg, Ok(key.map(str::as_bytes)), Some([127, 0, 0, 1].into()));
    let _ = writeln!(
        out,
        "key:          {}",
        match who {
            Ok(_) =>
                "the key that submitted the job (any other, or no such job: 404 job-not-found)",
            Err(e) => refused(e),
        }
    );
}

/// Why a request's key is refused (401), as `explain` says it.
fn refused(e: Unauthenticated) -> &'static str {
    match e {
        Unauthenticated::Missing => "none given → 401 unauthenticated (anonymous: reject)",
        Unauthenticated::Unknown => "not in the registry → 401 unauthenticated",
        Unauthenticated::Conflicting => "conflicting keys → 401 unauthenticated",
    }
}

/// `explain`'s `cost:` lines: the price, and how it is settled after the response.
fn explain_cost(out: &mut String, route: &Route) {
    let _ = writeln!(out, "cost:         {}", route.cost);
    if let Some(rate) = route.fidelity.cost_per_second {
        let _ = writeln!(
            out,
            "              then {rate} per second of upstream time, at least {} in total",
            route.cost
        );
    }
    if let Some(name) = &route.fidelity.cost_from_response {
        let bound = route
            .cost
            .saturating_mul(crate::route::stated::BOUND_FACTOR);
        let _ = writeln!(
            out,
            "              settled to what the upstream states in {name} (0 to {bound} units), when it does"
        );
    }
}

/// What the route itself does, whoever calls it: shadow mode, its upstream, its in-flight cap
/// and queue, its jobs.
fn explain_route(out: &mut String, route: &Route) {
    if route.fidelity.shadow {
        let _ = writeln!(
            out,
            "mode:         shadow (refusals are counted and forwarded, never enforced)"
        );
    }
    if let Some(name) = &route.provider.upstream {
        let _ = writeln!(
            out,
            "upstream:     {name}{}",
            route
                .provider
                .strip_prefix
                .as_deref()
                .map_or(String::new(), |p| format!(" (without the prefix {p})"))
        );
    }
    match route.max_in_flight {
        Some(n) => {
            let _ = writeln!(
                out,
                "in-flight:    at most {n} at once fleet-wide; wait up to {} for a slot, then 503",
                format_duration(route.queue_timeout)
            );
        }
        None => {
            let _ = writeln!(out, "in-flight:    no cap");
        }
    }
    if route.max_in_flight.is_some() {
        let _ = writeln!(
            out,
            "queue:        fair: a freed slot goes to the key running fewest here per its plan's weight; {}; {}",
            route
                .queue
                .max_queue
                .map_or("no bound on waiters".into(), |n| format!(
                    "at most {n} waiting fleet-wide (503 at once beyond)"
                )),
            route.queue.per_key.map_or("no per-key share".into(), |n| format!(
                "a key runs at most {n} at once here (it waits beyond)"
            ))
        );
    }
    if let Some(j) = &route.jobs {
        let _ = writeln!(out, "{}", crate::jobs::describe::explain_line(j));
    }
}

/// Who pays (`given_key`: whether a key was given at all) and every budget the request is
/// charged against on this route.
fn explain_key(out: &mut String, route: &Route, id: &Identity, given_key: bool) {
    let p = &id.policy;
    let _ = writeln!(
        out,
        "key:          {}",
        match &id.id {
            Some(i) => format!("registry id {i}"),
            None if given_key => format!("{} (no registry)", id.log_name()),
            None => "anonymous (client_ip)".into(),
        }
    );
    // Every budget the request is charged against (all must fit).
    for (i, b) in p.budgets.iter().enumerate() {
        let _ = writeln!(
            out,
            "{}\"{}\" {} units per {} (max_delay {})",
            if i == 0 {
                "budget:       "
            } else {
                "and budget:   "
            },
            b.name,
            b.max_cost,
            format_duration(b.window),
            format_duration(p.max_delay)
        );
        let _ = writeln!(
            out,
            "              = {} such requests in a burst, then one every {}",
            b.max_cost / route.cost,
            interval(b.window.as_secs_f64() * route.cost as f64 / b.max_cost as f64)
        );
    }
    if let Some(b) = route.shared() {
        let delay = Duration::from_micros(b.limit.max_delay_us());
        let _ = writeln!(
            out,
            "and shared:   \"{}\" {} units per {} for all callers of this route, fleet-wide (held up to {}, then 429)",
            b.name,
            b.max_cost,
            format_duration(b.window),
            format_duration(delay)
        );
    }
    if let Some(n) = p.max_in_flight_per_key {
        let _ = writeln!(out, "per key:      at most {n} in flight (429 beyond)");
    }
    if route.max_in_flight.is_some() {
        let _ = writeln!(out, "weight:       {} (plan \"{}\")", p.weight, p.name);
    }
}

/// An interval between requests, to a tenth of the unit that suits it (`10.0 s`, `36.0 ms`,
/// `1.2 µs`): seconds alone would say `0.0 s` of a fast refill.
fn interval(secs: f64) -> String {
    if secs >= 1.0 {
        format!("{secs:.1} s")
    } else if secs >= 1e-3 {
        format!("{:.1} ms", secs * 1e3)
    } else {
        format!("{:.1} µs", secs * 1e6)
    }
}
