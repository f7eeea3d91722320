//! From the file as written to the values the gateway runs on: one function per section, each
//! reporting every problem it finds with its path, so that one `tollgate check` shows them all.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::bounds::{shown, MAX_NAME_CHARS};
use super::error::{key_path, ConfigErrors};
use super::raw::{
    Backend, Listen, RawConfig, RawHealthCheck, RawIdentity, RawServer, RawStore, RawTls,
    RawUpstream,
};
use super::url::{parse_redis_target, parse_upstream_url};
use super::{
    Config, EnvOverrides, HealthCheck, IdentitySource, NamedUpstream, StoreSettings, UpstreamTarget,
};

/// `rate_limits`, `plans` and `keys`, which are checked against each other.
mod budgets;
mod endpoints;
mod jobs;
mod key_id;

use budgets::{default_policy, keys, plans};
use endpoints::endpoints;
use key_id::{key_id_header, source_header};

pub(super) fn validate(mut raw: RawConfig, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
    let mut errs = ConfigErrors::default();
    apply_env(&mut raw.store, env, &mut errs);
    let (listen, threads, max_connections) = server(&raw.server, &mut errs);
    let upstream = upstream("upstream", &raw.upstream, &mut errs);
    let upstreams = named_upstreams(&raw, &mut errs);
    let fleet_size = store(&raw.store, env, &mut errs);
    let tls = raw.server.tls.as_ref().and_then(|t| tls(t, &mut errs));
    distinct_listeners(&raw.server, &mut errs);
    let (sources, key_id_header) = identity(&raw.identity, &mut errs);
    let trusted_proxies = trusted_proxies(&raw.identity.trusted_proxies, &mut errs);
    let default_policy = default_policy(&raw.rate_limits.default, &mut errs);
    let plans = plans(&raw.plans, &raw.rate_limits.default, &mut errs);
    let router = endpoints(&raw.rate_limits, &raw.plans, &mut errs);
    endpoint_upstreams(&raw, &upstreams, &mut errs);
    cluster_support(&raw, &mut errs);
    let (mut keys, key_ids) = keys(
        &raw.keys,
        default_policy.as_ref(),
        (&plans, &raw.plans),
        &mut errs,
    );
    let tracing = super::traces::validate(raw.tracing.as_ref(), &mut errs);

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
        client_limits: super::ClientLimits {
            header_timeout: raw.server.header_timeout.0,
            body_timeout: raw.server.body_timeout.0,
            send_timeout: raw.server.send_timeout.0,
            idle_timeout: raw.server.idle_timeout.0,
            max_connections,
        },
        tls,
        upstream,
        upstreams,
        store: StoreSettings {
            backend: raw.store.backend,
            url: raw.store.url.clone(),
            timeout: raw.store.timeout.0,
            on_error: raw.store.on_error,
            fleet_size,
            lease_ttl: raw.store.lease_ttl.0,
            slices: raw.store.slices,
        },
        sources,
        anonymous: raw.identity.anonymous,
        trusted_proxies,
        forward_credentials: raw.identity.forward_credentials,
        key_id_header,
        default_policy,
        plans,
        keys,
        key_ids,
        router,
        tracing,
        raw,
        hash: String::new(),
    })
}

/// An endpoint's `upstream` must be one of `upstreams`.
fn endpoint_upstreams(
    raw: &RawConfig,
    upstreams: &HashMap<String, Arc<NamedUpstream>>,
    errs: &mut ConfigErrors,
) {
    for (pattern, e) in &raw.rate_limits.endpoints {
        if let Some(name) = &e.upstream {
            if !upstreams.contains_key(name) {
                errs.push(
                    format!("{}.upstream", key_path("rate_limits.endpoints", pattern)),
                    format!("unknown upstream \"{}\" (not in upstreams)", shown(name)),
                );
            }
        }
    }
}

/// What Redis Cluster cannot do yet: shared budgets.
fn cluster_support(raw: &RawConfig, errs: &mut ConfigErrors) {
    let on_cluster = raw.store.backend == Backend::Redis
        && matches!(
            parse_redis_target(&raw.store.url),
            Ok(super::RedisTarget::Cluster { .. })
        );
    for (pattern, e) in &raw.rate_limits.endpoints {
        if on_cluster && e.shared.is_some() {
            // The shared budget's key lives in the route's hash slot, the caller's budgets in
            // the key's: one script cannot charge both on Redis Cluster.
            errs.push(
                format!("{}.shared", key_path("rate_limits.endpoints", pattern)),
                "a shared budget needs a single Redis node or Sentinel (not yet supported on Redis Cluster)",
            );
        }
    }
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

/// `server`: the listen addresses, the worker thread count and the connection limit.
fn server(s: &RawServer, errs: &mut ConfigErrors) -> (Vec<String>, usize, usize) {
    let listen = s.listen.addrs();
    if listen.is_empty() {
        errs.push("server.listen", "at least one address is needed");
    }
    for (i, a) in listen.iter().enumerate() {
        if a.parse::<SocketAddr>().is_err() {
            errs.push(listen_path(s, i), format!("expected IP:PORT, got \"{a}\""));
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
    for (name, d) in [
        ("header_timeout", s.header_timeout),
        ("body_timeout", s.body_timeout),
        ("send_timeout", s.send_timeout),
        ("idle_timeout", s.idle_timeout),
    ] {
        if d.0.is_zero() {
            errs.push(format!("server.{name}"), "must be greater than 0");
        }
    }
    let max_connections = match s.max_connections {
        n if (1..=MAX_CONNECTIONS).contains(&n) => n as usize,
        n => {
            errs.push(
                "server.max_connections",
                format!("must be an integer between 1 and {MAX_CONNECTIONS}, got {n}"),
            );
            1
        }
    };
    (listen, threads, max_connections)
}

/// The path of `server.listen`'s `i`th address: the field itself when it is one address.
fn listen_path(s: &RawServer, i: usize) -> String {
    match s.listen {
        Listen::One(_) => "server.listen".to_string(),
        Listen::Many(_) => format!("server.listen[{i}]"),
    }
}

/// Every listener (`server.listen`, `server.tls.listen`, `server.admin_listen`) needs an address
/// of its own: two that bind the same port (the same address, or one of them "any address" of
/// the same family, or `[::]`, which takes IPv4 too) would pass `check` and then fail `run`
/// with "Address already in use".
/// Port 0 (the kernel picks a free one) never clashes.
fn distinct_listeners(s: &RawServer, errs: &mut ConfigErrors) {
    let dual_stack = dual_stack();
    let mut seen: Vec<(String, SocketAddr)> = Vec::new();
    let listen = s.listen.addrs();
    let named = listen
        .iter()
        .enumerate()
        .map(|(i, a)| (listen_path(s, i), a.as_str()))
        .chain(
            s.tls
                .iter()
                .map(|t| ("server.tls.listen".to_string(), t.listen.as_str())),
        )
        .chain([("server.admin_listen".to_string(), s.admin_listen.as_str())]);
    for (path, text) in named {
        let Ok(addr) = text.parse::<SocketAddr>() else {
            continue; // already reported as not IP:PORT
        };
        let clash = seen
            .iter()
            .find(|(_, other)| binds_same_port(addr, *other, dual_stack));
        if let Some((other, _)) = clash {
            errs.push(
                path.clone(),
                format!("{text} is taken by {other}: each listener needs an address of its own"),
            );
        }
        seen.push((path, addr));
    }
}

/// Whether listeners on `a` and `b` would take the same port: the same address, or "any
/// address" of the family beside a specific one, or — `dual_stack` — `[::]` beside any IPv4
/// address. Port 0 (the kernel picks a free one) never clashes.
pub(super) fn binds_same_port(a: SocketAddr, b: SocketAddr, dual_stack: bool) -> bool {
    if a.port() == 0 || a.port() != b.port() {
        return false;
    }
    if a.is_ipv4() == b.is_ipv4() {
        return a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified();
    }
    dual_stack
        && [a, b]
            .iter()
            .any(|x| x.is_ipv6() && x.ip().is_unspecified())
}

/// Whether a socket bound to `[::]` takes its port on IPv4 as well: Linux's default
/// (`net.ipv6.bindv6only` 0), assumed where that cannot be read.
fn dual_stack() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").map_or(true, |v| v.trim() != "1")
}

/// `server.tls`: the listener's address, and a certificate and key that can be served (read
/// now, so that a file Pingora would panic on is a config error instead).
fn tls(t: &RawTls, errs: &mut ConfigErrors) -> Option<crate::tls::TlsListener> {
    if t.listen.parse::<SocketAddr>().is_err() {
        errs.push(
            "server.tls.listen",
            format!("expected IP:PORT, got \"{}\"", shown(&t.listen)),
        );
    }
    let (cert, key) = (
        std::path::PathBuf::from(&t.cert),
        std::path::PathBuf::from(&t.key),
    );
    match crate::tls::load_key_pair(&cert, &key) {
        Ok(certified) => Some(crate::tls::TlsListener {
            listen: t.listen.clone(),
            cert,
            key,
            certified: Arc::new(certified),
        }),
        Err(e) => {
            errs.push(e.field(), e.to_string());
            // A certificate that cannot be read stops the pair's check before its key: the
            // key is read too, so that both are reported at once.
            if let (crate::tls::TlsError::Cert(_), Err(k)) = (&e, crate::tls::read_key(&key)) {
                errs.push(k.field(), k.to_string());
            }
            None
        }
    }
}

/// Far above what one process can hold open (file descriptors), and a safe `usize`.
const MAX_CONNECTIONS: i64 = 10_000_000;

/// `upstream`: where admitted requests go.
/// `upstreams:`: each one `url` or a pool of `urls`, with the default upstream's timeouts
/// unless it gives its own.
fn named_upstreams(
    raw: &RawConfig,
    errs: &mut ConfigErrors,
) -> HashMap<String, Arc<NamedUpstream>> {
    let mut out = HashMap::new();
    for (name, u) in &raw.upstreams {
        let base = key_path("upstreams", name);
        if name.is_empty()
            || name.chars().count() > MAX_NAME_CHARS
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                key_path("upstreams", &shown(name)),
                format!(
                    "an upstream name uses 1 to {MAX_NAME_CHARS} letters, digits, '-', '_' or '.'"
                ),
            );
            continue;
        }
        let urls: Vec<(String, &String)> = match (&u.url, &u.urls) {
            (Some(url), None) => vec![(format!("{base}.url"), url)],
            (None, Some(urls)) if !urls.is_empty() => urls
                .iter()
                .enumerate()
                .map(|(i, url)| (format!("{base}.urls[{i}]"), url))
                .collect(),
            (None, Some(_)) => {
                errs.push(format!("{base}.urls"), "lists at least one address");
                continue;
            }
            _ => {
                errs.push(base.clone(), "needs exactly one of url or urls");
                continue;
            }
        };
        let mut targets = vec![];
        for (path, url) in urls {
            let one = RawUpstream {
                url: url.clone(),
                connect_timeout: u.connect_timeout.unwrap_or(raw.upstream.connect_timeout),
                read_timeout: u.read_timeout.unwrap_or(raw.upstream.read_timeout),
                abandon_timeout: u.abandon_timeout.or(raw.upstream.abandon_timeout),
                ca_file: None,
            };
            if let Some(t) = upstream(&path, &one, errs) {
                targets.push(t);
            }
        }
        let health_check = u
            .health_check
            .as_ref()
            .and_then(|h| health_check(&base, h, errs));
        out.insert(
            name.clone(),
            Arc::new(NamedUpstream {
                name: name.clone(),
                targets,
                health_check,
            }),
        );
    }
    out
}

/// `upstreams.<name>.health_check`: a path to GET and how often.
fn health_check(base: &str, h: &RawHealthCheck, errs: &mut ConfigErrors) -> Option<HealthCheck> {
    let path_ok = h.path.starts_with('/');
    if !path_ok {
        errs.push(format!("{base}.health_check.path"), "must start with /");
    }
    if h.interval.0.is_zero() {
        errs.push(
            format!("{base}.health_check.interval"),
            "must be greater than 0",
        );
    }
    if !path_ok || h.interval.0.is_zero() {
        return None;
    }
    Some(HealthCheck {
        path: h.path.clone(),
        interval: h.interval.0,
    })
}

/// An upstream's address and timeouts; errors are reported under `base` (`upstream.url` for
/// the default upstream's `url`, the address's own path for a named one).
fn upstream(base: &str, u: &RawUpstream, errs: &mut ConfigErrors) -> Option<UpstreamTarget> {
    let (url_path, base) = if base == "upstream" {
        ("upstream.url".to_string(), "upstream".to_string())
    } else {
        let parent = base.rsplit_once('.').map_or(base, |(p, _)| p).to_string();
        (base.to_string(), parent)
    };
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
                abandon_timeout: u
                    .abandon_timeout
                    .map_or(u.read_timeout.0.saturating_mul(10), |d| d.0),
                ca_file: u.ca_file.clone(),
            })
        }
        Err(m) => {
            errs.push(url_path, m.to_string());
            None
        }
    };
    if let Some(f) = &u.ca_file {
        if let Err(e) = std::fs::metadata(f) {
            errs.push(
                format!("{base}.ca_file"),
                format!("cannot read {}: {e}", super::error::shown_path(f)),
            );
        }
    }
    if u.connect_timeout.0.is_zero() {
        errs.push(format!("{base}.connect_timeout"), "must be greater than 0");
    }
    if u.read_timeout.0.is_zero() {
        errs.push(format!("{base}.read_timeout"), "must be greater than 0");
    }
    if let Some(a) = u.abandon_timeout {
        if a.0 < u.read_timeout.0 {
            errs.push(
                format!("{base}.abandon_timeout"),
                format!(
                    "must be at least read_timeout ({}), got {}",
                    super::duration::format_duration(u.read_timeout.0),
                    super::duration::format_duration(a.0)
                ),
            );
        }
    }
    target
}

/// `store`: returns the fleet size (1 when it is invalid, with an error). The URL is checked
/// whatever the backend (DESIGN §1): only Redis reads it, but a file that says it is wrong.
fn store(s: &RawStore, env: &EnvOverrides, errs: &mut ConfigErrors) -> u32 {
    if let Err(m) = parse_redis_target(&s.url) {
        if env.redis_url.is_some() {
            errs.push("store.url", format!("{m} (from TOLLGATE_REDIS_URL)"));
        } else {
            errs.push("store.url", m.to_string());
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
        let from = if env.fleet_size.is_some() {
            " (from TOLLGATE_FLEET_SIZE)"
        } else {
            ""
        };
        errs.push(
            "store.fleet_size",
            format!(
                "must be an integer between 1 and 10000, got {}{from}",
                s.fleet_size
            ),
        );
        1
    }
}

/// `identity`: where the API key is read from, and the header that names it upstream.
fn identity(
    id: &RawIdentity,
    errs: &mut ConfigErrors,
) -> (Vec<IdentitySource>, Option<http::HeaderName>) {
    let mut sources = Vec::new();
    if id.sources.is_empty() {
        errs.push("identity.sources", "at least one source is needed");
    }
    for (i, s) in id.sources.iter().enumerate() {
        if s == "bearer" {
            sources.push(IdentitySource::Bearer);
        } else if let Some(h) = s.strip_prefix("header:") {
            match http::HeaderName::from_bytes(h.as_bytes()) {
                Ok(name) if !h.is_empty() => match source_header(h, &name) {
                    Ok(()) => sources.push(IdentitySource::Header(name)),
                    Err(m) => errs.push(format!("identity.sources[{i}]"), m.to_string()),
                },
                _ => errs.push(
                    format!("identity.sources[{i}]"),
                    format!("invalid header name in \"{s}\""),
                ),
            }
        } else {
            errs.push(
                format!("identity.sources[{i}]"),
                format!(
                    "expected \"header:<name>\" or \"bearer\", got {}",
                    super::error::shown(s)
                ),
            );
        }
    }
    let key_id_header = match key_id_header(&id.key_id_header, &sources) {
        Ok(h) => h,
        Err(m) => {
            errs.push("identity.key_id_header", m.to_string());
            None
        }
    };
    (sources, key_id_header)
}

/// `identity.trusted_proxies`: CIDRs (`10.0.0.0/8`) or single addresses, in normalized form.
fn trusted_proxies(list: &[String], errs: &mut ConfigErrors) -> super::origin::TrustedProxies {
    let mut nets = Vec::new();
    for (i, s) in list.iter().enumerate() {
        let path = format!("identity.trusted_proxies[{i}]");
        let net = s
            .parse::<ipnet::IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from));
        match net {
            Ok(n) if n.trunc() != n => errs.push(
                path,
                format!(
                    "\"{s}\" has host bits set; the network is \"{}\"",
                    n.trunc()
                ),
            ),
            Ok(n) => nets.push(n),
            Err(_) => errs.push(
                path,
                format!(
                    "expected a CIDR such as \"10.0.0.0/8\" or an IP address, got \"{}\"",
                    shown(s)
                ),
            ),
        }
    }
    super::origin::TrustedProxies::new(nets)
}
