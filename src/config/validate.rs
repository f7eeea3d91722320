//! From the file as written to the values the gateway runs on: one function per section, each
//! reporting every problem it finds with its path, so that one `tollgate check` shows them all.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::bounds::{shown, MAX_NAME_CHARS, MAX_PATTERN_CHARS};
use super::error::{key_path, ConfigErrors};
use super::pattern::check_endpoint;
use super::raw::{
    Backend, Listen, RawConfig, RawDefault, RawIdentity, RawKey, RawPlan, RawRateLimits, RawServer,
    RawStore, RawUpstream,
};
use super::url::{check_redis_url, parse_upstream_url};
use super::{Config, EnvOverrides, IdentitySource, KeyEntry, StoreSettings, UpstreamTarget};
use crate::budget::Limit;
use crate::policy::{Policy, PolicyHeaders};
use crate::route::{RouteSpec, Router};

pub(super) fn validate(mut raw: RawConfig, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
    let mut errs = ConfigErrors::default();
    apply_env(&mut raw.store, env, &mut errs);
    let (listen, threads) = server(&raw.server, &mut errs);
    let upstream = upstream(&raw.upstream, &mut errs);
    let fleet_size = store(&raw.store, env.redis_url.is_some(), &mut errs);
    let sources = identity(&raw.identity, &mut errs);
    let default_policy = default_policy(&raw.rate_limits.default, &mut errs);
    let plans = plans(&raw.plans, &raw.rate_limits.default, &mut errs);
    let router = endpoints(&raw.rate_limits, &raw.plans, &mut errs);
    let (mut keys, key_ids) = keys(&raw.keys, default_policy.as_ref(), &plans, &mut errs);

    if !errs.0.is_empty() {
        return Err(errs);
    }
    let (Some(upstream), Some(default_policy), Some(router)) = (upstream, default_policy, router)
    else {
        // Unreachable: each None above pushed an error.
        return Err(ConfigErrors::one(".", "invalid configuration"));
    };
    // Registry entries without a plan share the default policy.
    let default_policy = Arc::new(default_policy);
    for entry in keys.values_mut() {
        if entry.policy.name == "default" {
            entry.policy = default_policy.clone();
        }
    }
    Ok(Config {
        listen,
        admin_listen: raw.server.admin_listen.clone(),
        threads,
        grace_period: raw.server.grace_period.0,
        client_limits: crate::front::ClientLimits::default(),
        upstream,
        store: StoreSettings {
            backend: raw.store.backend,
            url: raw.store.url.clone(),
            timeout: raw.store.timeout.0,
            on_error: raw.store.on_error,
            fleet_size,
            lease_ttl: raw.store.lease_ttl.0,
        },
        sources,
        anonymous: raw.identity.anonymous,
        default_policy,
        plans,
        keys,
        key_ids,
        router,
        raw,
    })
}

/// `TOLLGATE_REDIS_URL` and `TOLLGATE_FLEET_SIZE` replace what the file says.
fn apply_env(store: &mut RawStore, env: &EnvOverrides, errs: &mut ConfigErrors) {
    if let Some(url) = &env.redis_url {
        store.url = url.clone();
    }
    if let Some(n) = &env.fleet_size {
        match n.trim().parse::<i64>() {
            Ok(n) => store.fleet_size = n,
            Err(_) => errs.push(
                "TOLLGATE_FLEET_SIZE",
                format!("must be a positive integer, got \"{n}\""),
            ),
        }
    }
}

/// `server`: the listen addresses and the worker thread count.
fn server(s: &RawServer, errs: &mut ConfigErrors) -> (Vec<String>, usize) {
    let listen = s.listen.addrs();
    if listen.is_empty() {
        errs.push("server.listen", "at least one address is needed");
    }
    for (i, a) in listen.iter().enumerate() {
        if a.parse::<SocketAddr>().is_err() {
            let p = match s.listen {
                Listen::One(_) => "server.listen".to_string(),
                Listen::Many(_) => format!("server.listen[{i}]"),
            };
            errs.push(p, format!("expected IP:PORT, got \"{a}\""));
        }
    }
    if s.admin_listen.parse::<SocketAddr>().is_err() {
        errs.push(
            "server.admin_listen",
            format!("expected IP:PORT, got \"{}\"", s.admin_listen),
        );
    }
    let threads = match s.threads {
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        Some(n) if (1..=1024).contains(&n) => n as usize,
        Some(n) => {
            errs.push(
                "server.threads",
                format!("must be between 1 and 1024, got {n}"),
            );
            1
        }
    };
    (listen, threads)
}

/// `upstream`: where admitted requests go.
fn upstream(u: &RawUpstream, errs: &mut ConfigErrors) -> Option<UpstreamTarget> {
    let target = match parse_upstream_url(&u.url) {
        Ok((tls, host, port)) => {
            let default_port = if tls { 443 } else { 80 };
            let authority = if port == default_port {
                host.clone()
            } else if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            Some(UpstreamTarget {
                tls,
                host,
                port,
                host_header: http::HeaderValue::from_str(&authority)
                    .unwrap_or_else(|_| http::HeaderValue::from_static("")),
                authority,
                connect_timeout: u.connect_timeout.0,
                read_timeout: u.read_timeout.0,
                ca_file: u.ca_file.clone(),
            })
        }
        Err(m) => {
            errs.push("upstream.url", m);
            None
        }
    };
    if let Some(f) = &u.ca_file {
        if let Err(e) = std::fs::metadata(f) {
            errs.push("upstream.ca_file", format!("cannot read \"{f}\": {e}"));
        }
    }
    if u.connect_timeout.0.is_zero() {
        errs.push("upstream.connect_timeout", "must be greater than 0");
    }
    if u.read_timeout.0.is_zero() {
        errs.push("upstream.read_timeout", "must be greater than 0");
    }
    target
}

/// `store`: returns the fleet size (1 when it is invalid, with an error). The URL is only
/// read by the Redis backend, so only checked for it.
fn store(s: &RawStore, url_from_env: bool, errs: &mut ConfigErrors) -> u32 {
    if s.backend == Backend::Redis {
        if let Err(m) = check_redis_url(&s.url) {
            if url_from_env {
                errs.push("store.url", format!("{m} (from TOLLGATE_REDIS_URL)"));
            } else {
                errs.push("store.url", m);
            }
        }
    }
    if s.timeout.0.is_zero() {
        errs.push("store.timeout", "must be greater than 0");
    }
    if s.lease_ttl.0 < Duration::from_secs(1) {
        errs.push("store.lease_ttl", "must be at least 1s");
    }
    if (1..=10_000).contains(&s.fleet_size) {
        s.fleet_size as u32
    } else {
        errs.push(
            "store.fleet_size",
            format!(
                "must be an integer between 1 and 10000, got {}",
                s.fleet_size
            ),
        );
        1
    }
}

/// `identity`: where the API key is read from.
fn identity(id: &RawIdentity, errs: &mut ConfigErrors) -> Vec<IdentitySource> {
    let mut sources = Vec::new();
    if id.sources.is_empty() {
        errs.push("identity.sources", "at least one source is needed");
    }
    for (i, s) in id.sources.iter().enumerate() {
        if s == "bearer" {
            sources.push(IdentitySource::Bearer);
        } else if let Some(h) = s.strip_prefix("header:") {
            if h.is_empty() || http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                errs.push(
                    format!("identity.sources[{i}]"),
                    format!("invalid header name in \"{s}\""),
                );
            } else {
                sources.push(IdentitySource::Header(h.to_ascii_lowercase()));
            }
        } else {
            errs.push(
                format!("identity.sources[{i}]"),
                format!("expected \"header:<name>\" or \"bearer\", got \"{s}\""),
            );
        }
    }
    sources
}

/// `rate_limits.default`: the budget of every key without a plan.
fn default_policy(d: &RawDefault, errs: &mut ConfigErrors) -> Option<Policy> {
    let policy = build_policy(
        "default",
        "rate_limits.default",
        d.max_cost,
        d.window.0,
        d.max_delay.0,
        None,
        errs,
    );
    if d.cost <= 0 {
        errs.push(
            "rate_limits.default.cost",
            format!("must be a positive integer, got {}", d.cost),
        );
    }
    policy
}

/// `plans`: per-customer budgets; a plan without `max_delay` inherits the default's.
fn plans(
    raw: &BTreeMap<String, RawPlan>,
    d: &RawDefault,
    errs: &mut ConfigErrors,
) -> HashMap<String, Arc<Policy>> {
    let mut plans = HashMap::new();
    for (name, p) in raw {
        let chars = name.chars().count();
        if chars > MAX_NAME_CHARS {
            errs.push(
                key_path("plans", &shown(name)),
                format!("a plan name is at most {MAX_NAME_CHARS} characters, got {chars}"),
            );
            continue;
        }
        let base = key_path("plans", name);
        // Plan names go into RateLimit headers as structured-field strings.
        if name == "default"
            || name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                base.clone(),
                "a plan name uses only letters, digits, '-', '_' or '.', and is not \"default\" (that is rate_limits.default)",
            );
        }
        let per_key = concurrency_cap(
            format!("{base}.max_in_flight_per_key"),
            p.max_in_flight_per_key,
            errs,
        );
        if let Some(policy) = build_policy(
            name,
            &base,
            p.max_cost,
            p.window.0,
            p.max_delay.map(|d| d.0).unwrap_or(d.max_delay.0),
            per_key,
            errs,
        ) {
            plans.insert(name.clone(), Arc::new(policy));
        }
    }
    plans
}

/// `rate_limits.endpoints`: the route table. Every cost (the default's too) must fit every
/// budget, or some request could never pass.
fn endpoints(
    rl: &RawRateLimits,
    plans: &BTreeMap<String, RawPlan>,
    errs: &mut ConfigErrors,
) -> Option<Router> {
    let d = &rl.default;
    let budgets: Vec<(String, u64)> =
        std::iter::once(("rate_limits.default".to_string(), d.max_cost))
            .chain(
                plans
                    .iter()
                    .map(|(n, p)| (key_path("plans", n), p.max_cost)),
            )
            .filter(|(_, m)| *m > 0)
            .map(|(n, m)| (n, m as u64))
            .collect();
    let check_fits = |path: String, cost: i64, errs: &mut ConfigErrors| {
        if cost <= 0 {
            return;
        }
        for (bname, max) in &budgets {
            if cost as u64 > *max {
                errs.push(
                    path.clone(),
                    format!("cost {cost} exceeds {bname}.max_cost {max}: such a request could never pass"),
                );
            }
        }
    };
    check_fits("rate_limits.default.cost".into(), d.cost, errs);

    let mut specs = Vec::new();
    for (pattern, e) in &rl.endpoints {
        let chars = pattern.chars().count();
        if chars > MAX_PATTERN_CHARS {
            errs.push(
                key_path("rate_limits.endpoints", &shown(pattern)),
                format!(
                    "an endpoint pattern is at most {MAX_PATTERN_CHARS} characters, got {chars}"
                ),
            );
            continue;
        }
        let base = key_path("rate_limits.endpoints", pattern);
        let cost = e.cost.unwrap_or(d.cost);
        if cost <= 0 {
            errs.push(
                format!("{base}.cost"),
                format!("must be a positive integer, got {cost}"),
            );
        }
        check_fits(format!("{base}.cost"), cost, errs);
        let max_in_flight = concurrency_cap(format!("{base}.max_in_flight"), e.max_in_flight, errs);
        if e.queue_timeout.is_some() && max_in_flight.is_none() {
            errs.push(
                format!("{base}.queue_timeout"),
                "only applies together with max_in_flight",
            );
        }
        if let Err(m) = check_endpoint(pattern) {
            errs.push(base, m);
            continue;
        }
        specs.push(RouteSpec {
            pattern: pattern.clone(),
            cost: cost.max(1) as u64,
            max_in_flight,
            queue_timeout: e.queue_timeout.map(|d| d.0).unwrap_or_default(),
        });
    }
    match Router::new(specs, d.cost.max(1) as u64) {
        Ok(r) => Some(r),
        Err(route_errs) => {
            for (pattern, m) in route_errs {
                errs.push(key_path("rate_limits.endpoints", &pattern), m);
            }
            None
        }
    }
}

type Registry = (HashMap<[u8; 32], KeyEntry>, HashMap<String, [u8; 32]>);

/// `keys`: the registry, by sha256 and by id. Keys without a plan get (a copy of) the default
/// policy; the caller makes them share one.
fn keys(
    raw: &[RawKey],
    default_policy: Option<&Policy>,
    plans: &HashMap<String, Arc<Policy>>,
    errs: &mut ConfigErrors,
) -> Registry {
    let mut keys = HashMap::new();
    let mut key_ids = HashMap::new();
    for (i, k) in raw.iter().enumerate() {
        let base = format!("keys[{i}]");
        let chars = k.id.chars().count();
        if chars > MAX_NAME_CHARS {
            errs.push(
                format!("{base}.id"),
                format!("a key id is at most {MAX_NAME_CHARS} characters, got {chars}"),
            );
        } else if k.id.is_empty()
            || !k
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                format!("{base}.id"),
                format!(
                    "must be non-empty and use only letters, digits, '-', '_' or '.', got \"{}\"",
                    k.id
                ),
            );
        }
        let hash = match hex::decode(k.sha256.trim()) {
            Ok(b) if b.len() == 32 => {
                let mut h = [0u8; 32];
                h.copy_from_slice(&b);
                Some(h)
            }
            _ => {
                errs.push(
                    format!("{base}.sha256"),
                    "must be the 64 hex digits of the key's sha256 (raw keys never go in the config)",
                );
                None
            }
        };
        let policy = match &k.plan {
            None => default_policy.cloned().map(Arc::new),
            Some(p) => match plans.get(p) {
                Some(pol) => Some(pol.clone()),
                None => {
                    errs.push(
                        format!("{base}.plan"),
                        format!("unknown plan \"{}\"", shown(p)),
                    );
                    None
                }
            },
        };
        if let (Some(hash), Some(policy)) = (hash, policy) {
            if keys.contains_key(&hash) {
                errs.push(format!("{base}.sha256"), "duplicate key");
            }
            if key_ids.insert(k.id.clone(), hash).is_some() {
                errs.push(format!("{base}.id"), format!("duplicate id \"{}\"", k.id));
            }
            keys.insert(
                hash,
                KeyEntry {
                    id: Arc::from(k.id.as_str()),
                    policy,
                },
            );
        }
    }
    (keys, key_ids)
}

/// An optional in-flight cap: a positive integer up to a million.
fn concurrency_cap(path: String, value: Option<i64>, errs: &mut ConfigErrors) -> Option<u32> {
    match value {
        Some(n) if (1..=1_000_000).contains(&n) => Some(n as u32),
        Some(n) => {
            errs.push(
                path,
                format!("must be a positive integer (at most 1000000), got {n}"),
            );
            None
        }
        None => None,
    }
}

fn build_policy(
    name: &str,
    base: &str,
    max_cost: i64,
    window: Duration,
    max_delay: Duration,
    max_in_flight_per_key: Option<u32>,
    errs: &mut ConfigErrors,
) -> Option<Policy> {
    let mut ok = true;
    if max_cost <= 0 {
        errs.push(
            format!("{base}.max_cost"),
            format!("must be a positive integer, got {max_cost}"),
        );
        ok = false;
    }
    if window.is_zero() {
        errs.push(format!("{base}.window"), "must be greater than 0");
        ok = false;
    }
    if !ok {
        return None;
    }
    match Limit::new(max_cost as u64, window, max_delay) {
        Ok(limit) => Some(Policy {
            name: name.to_string(),
            max_cost: max_cost as u64,
            window,
            max_delay,
            max_in_flight_per_key,
            limit,
            headers: PolicyHeaders::new(name, max_cost as u64, window),
        }),
        Err(m) => {
            errs.push(format!("{base}.max_cost"), m);
            None
        }
    }
}
