//! The two URLs of gateway.yaml: the upstream's (`http[s]://host[:port]`) and the store's,
//! which may carry a password and so is shown only redacted.

/// `redis://user:secret@host` → `redis://user:***@host`; a query's values are hidden too
/// (`?password=secret` → `?password=***`).
pub fn redact_url(url: &str) -> String {
    // The user information first (a password may hold a '?' or a '#'), then the query of
    // what follows it.
    let hidden = redact_userinfo(url);
    let after = hidden
        .rfind('@')
        .or_else(|| hidden.find("://").map(|i| i + 2))
        .map_or(0, |i| i + 1);
    match hidden[after..].find(['?', '#']) {
        Some(i) => format!(
            "{}{}",
            &hidden[..after + i],
            redact_query(&hidden[after + i..])
        ),
        None => hidden,
    }
}

/// `?a=1&b=2#f` → `?a=***&b=***#f`.
fn redact_query(tail: &str) -> String {
    let (query, fragment) = match tail.find('#') {
        Some(i) => (&tail[..i], Some(&tail[i + 1..])),
        None => (tail, None),
    };
    let mut out = String::new();
    if let Some(q) = query.strip_prefix('?') {
        let pairs: Vec<String> = q
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((name, _)) => format!("{name}=***"),
                None => p.to_string(),
            })
            .collect();
        out = format!("?{}", pairs.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    out
}

fn redact_userinfo(url: &str) -> String {
    // The scheme's end: after `://`, or, in a URL that mistypes it (`redis:/:pw@h`,
    // `redis//:pw@h`, `:pw@h`), after the leading word and the ':' and '/' that follow it,
    // so that a password is hidden however the rest is written.
    let start = match url.find("://") {
        Some(i) => i + 3,
        None => {
            let word = url
                .find(|c: char| !(c.is_ascii_alphanumeric() || "+.-".contains(c)))
                .unwrap_or(url.len());
            word + url[word..]
                .find(|c| c != ':' && c != '/')
                .unwrap_or(url.len() - word)
        }
    };
    let rest = &url[start..];
    // Everything up to the last '@' is user information, even when a password holds a '/'
    // (invalid, but it must not be shown): store URLs' paths (`/db`) never hold an '@'.
    let authority = rest;
    match authority.rfind('@') {
        None => url.to_string(),
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let redacted = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                "***".to_string()
            };
            format!("{}{}@{}", &url[..start], redacted, &rest[at + 1..])
        }
    }
}

/// Why an upstream URL was refused; each quotes the URL (redacted when it has credentials).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamUrlError {
    #[error("credentials in the upstream URL are not supported (send them from the upstream's side), got \"{0}\"")]
    Credentials(String),
    #[error("must start with http:// or https://, got \"{0}\"")]
    Scheme(String),
    #[error("expected scheme://host[:port] without a path, got \"{0}\"")]
    HasPath(String),
    #[error("bad IPv6 address in \"{0}\"")]
    BadIpv6(String),
    #[error("bad port in \"{0}\"")]
    BadPort(String),
    #[error("missing host in \"{0}\"")]
    MissingHost(String),
}

/// `http://host[:port][/]` or `https://…` → (tls, host, port).
pub(super) fn parse_upstream_url(raw: &str) -> Result<(bool, String, u16), UpstreamUrlError> {
    use UpstreamUrlError as E;
    // Errors quote the URL, and a URL with user:pass@ carries a secret: quote it redacted.
    if raw.contains('@') {
        return Err(E::Credentials(redact_url(raw)));
    }
    let url = raw;
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(E::Scheme(url.into()));
    };
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(E::HasPath(url.into()));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let end = v6.find(']').ok_or_else(|| E::BadIpv6(url.into()))?;
        let host = &v6[..end];
        let port = match &v6[end + 1..] {
            "" => default_port,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| E::BadPort(url.into()))?,
        };
        (host.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse().map_err(|_| E::BadPort(url.into()))?,
            ),
            None => (authority.to_string(), default_port),
        }
    };
    if host.is_empty() {
        return Err(E::MissingHost(url.into()));
    }
    Ok((tls, host, port))
}

/// What `store.url` names (DESIGN §1), read once: `check` and the store use the same parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://` or `rediss://`: one node, the URL as the client reads it.
    Node(String),
    /// `redis[s]+cluster://[user:pass@]h1:p1,h2:p2,…`: the seed nodes, one `redis[s]://` URL
    /// each (with the credentials); the client learns the rest of the topology from them.
    Cluster { seeds: Vec<String> },
    /// `redis[s]+sentinel://[user:pass@]h1:p1,h2:p2/<master-name>[/<db>]`: the Sentinels
    /// (`redis[s]://host:port`, no credentials), the master's name, and how to reach the
    /// primary they name: `primary` is a `redis[s]://[user:pass@]sentinel-named/<db>` URL whose
    /// host is a placeholder (Sentinel says the address) and whose rest (TLS, credentials,
    /// database) applies to the primary.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
        primary: String,
    },
}

/// Default ports of the multi-host forms (a Sentinel listens on 26379).
const CLUSTER_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;

/// Why `store.url` was refused; each quotes the URL redacted (`shown`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreUrlError {
    #[error("must start with redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel:// (got \"{0}\")")]
    Scheme(String),
    #[error("{scheme}:// takes no query or fragment (got \"{shown}\")")]
    QueryOrFragment { scheme: String, shown: String },
    #[error("every address in the list needs a host, as in h1:6379,h2:6379 (got \"{0}\")")]
    EmptyAddress(String),
    #[error("a Redis Cluster has only database 0: give no path (got \"{0}\")")]
    ClusterDatabase(String),
    #[error("name the master after the hosts, as in {scheme}://h1:26379,h2:26379/mymaster (letters, digits, - _ .) (got \"{shown}\")")]
    MasterName { scheme: String, shown: String },
    #[error("cannot be parsed: {why} (got \"{shown}\")")]
    Unparsable { why: String, shown: String },
    #[error("the host is missing (got \"{0}\")")]
    NoHost(String),
    #[error("the port must be between 1 and 65535 (got \"{0}\")")]
    PortZero(String),
    #[error("cannot be used: {why} (got \"{shown}\")")]
    Unusable { why: String, shown: String },
    #[error("the database number must be 0 or more (got \"{0}\")")]
    NegativeDatabase(String),
}

/// Reads `store.url` the way the Redis client will when the gateway runs, so that `check`
/// refuses a URL that `run` could never connect with. The error shows the URL only redacted.
pub fn parse_redis_target(url: &str) -> Result<RedisTarget, StoreUrlError> {
    use StoreUrlError as E;
    let shown = redact_url(url);
    let (scheme, rest) = url.split_once("://").unwrap_or(("", ""));
    // The client reads no password (nor anything else tollgate relies on) from a query: one
    // there would be ignored, and shown in /admin/config.
    if rest.contains(['?', '#']) && scheme.starts_with("redis") {
        return Err(E::QueryOrFragment {
            scheme: scheme.into(),
            shown,
        });
    }
    let (tls, kind) = match scheme {
        "redis" | "rediss" => {
            check_node_url(url, &shown)?;
            return Ok(RedisTarget::Node(url.to_string()));
        }
        "redis+cluster" => (false, "cluster"),
        "rediss+cluster" => (true, "cluster"),
        "redis+sentinel" => (false, "sentinel"),
        "rediss+sentinel" => (true, "sentinel"),
        _ => return Err(E::Scheme(shown)),
    };
    let node_scheme = if tls { "rediss" } else { "redis" };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..at + 1], &authority[at + 1..]),
        None => ("", authority),
    };
    let inner = &userinfo[..userinfo.len().saturating_sub(1)];
    if inner.find('@').is_some_and(|at| inner[at..].contains(',')) {
        // `:pw1@h1,:pw2@h2`: one host's credentials each is not a form the URL has (the
        // first host would be taken as part of the password). A raw '@' in a password
        // without a host list after it (`:p@ss@h1,h2`) is read as before: up to the last '@'.
        return Err(E::Unusable {
            why: "give the credentials once, before every host (user:password@h1,h2; an '@' in a password is written %40)".into(),
            shown,
        });
    }
    let default_port = if kind == "cluster" {
        CLUSTER_PORT
    } else {
        SENTINEL_PORT
    };
    let nodes = host_list(hosts, default_port, &shown)?;
    let multi = MultiHost {
        node_scheme,
        userinfo,
        nodes,
        shown,
    };
    if kind == "cluster" {
        multi.cluster(path)
    } else {
        multi.sentinel(scheme, path)
    }
}

/// The comma-separated hosts of a multi-host URL, each with a port (`default_port` when it
/// names none).
fn host_list(hosts: &str, default_port: u16, shown: &str) -> Result<Vec<String>, StoreUrlError> {
    let mut nodes = vec![];
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() {
            return Err(StoreUrlError::EmptyAddress(shown.into()));
        }
        let has_port = match host.rfind(']') {
            Some(end) => host[end..].contains(':'),
            None => host.contains(':'),
        };
        let host = if has_port {
            host.to_string()
        } else {
            format!("{host}:{default_port}")
        };
        nodes.push(host);
    }
    Ok(nodes)
}

/// A `redis[s]+cluster://` or `redis[s]+sentinel://` URL taken apart: what its node URLs are
/// made of.
struct MultiHost<'a> {
    /// `redis` or `rediss`.
    node_scheme: &'static str,
    /// `user:pass@`, or empty.
    userinfo: &'a str,
    nodes: Vec<String>,
    shown: String,
}

impl MultiHost<'_> {
    /// `redis[s]+cluster://h1,h2[/0]`: one seed URL per host, credentials on each.
    fn cluster(self, path: &str) -> Result<RedisTarget, StoreUrlError> {
        let MultiHost {
            node_scheme,
            userinfo,
            nodes,
            shown,
        } = self;
        if !matches!(path, "" | "0") {
            return Err(StoreUrlError::ClusterDatabase(shown));
        }
        let seeds: Vec<String> = nodes
            .iter()
            .map(|h| format!("{node_scheme}://{userinfo}{h}"))
            .collect();
        for seed in &seeds {
            check_node_url(seed, &shown)?;
        }
        Ok(RedisTarget::Cluster { seeds })
    }

    /// `redis[s]+sentinel://h1,h2/<master>[/<db>]`: the Sentinels without credentials, which
    /// go to the primary.
    fn sentinel(self, scheme: &str, path: &str) -> Result<RedisTarget, StoreUrlError> {
        let MultiHost {
            node_scheme,
            userinfo,
            nodes,
            shown,
        } = self;
        let (master, db) = path.split_once('/').unwrap_or((path, "0"));
        let db = if db.is_empty() { "0" } else { db };
        if master.is_empty()
            || !master
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(StoreUrlError::MasterName {
                scheme: scheme.into(),
                shown,
            });
        }
        let sentinels: Vec<String> = nodes
            .iter()
            .map(|h| format!("{node_scheme}://{h}"))
            .collect();
        for s in &sentinels {
            check_node_url(s, &shown)?;
        }
        let primary = format!("{node_scheme}://{userinfo}sentinel-named/{db}");
        check_node_url(&primary, &shown)?;
        Ok(RedisTarget::Sentinel {
            sentinels,
            master: master.to_string(),
            primary,
        })
    }
}

/// One node's `redis[s]://` URL, as the client will read it; errors quote `shown`.
fn check_node_url(url: &str, shown: &str) -> Result<(), StoreUrlError> {
    use StoreUrlError as E;
    let parsed = redis::parse_redis_url(url).ok_or_else(|| {
        // The same parser, asked again for its reason (parse_redis_url keeps it to itself).
        let why = ::url::Url::parse(url)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "not a URL".into());
        E::Unparsable {
            why,
            shown: shown.into(),
        }
    })?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(E::NoHost(shown.into()));
    }
    if parsed.port() == Some(0) {
        return Err(E::PortZero(shown.into()));
    }
    let info = redis::IntoConnectionInfo::into_connection_info(parsed).map_err(|e| {
        // "Invalid database number - InvalidClientConfig": the part a user can act on.
        let e = e.to_string();
        let why = e.split(" - ").next().unwrap_or(&e).to_string();
        E::Unusable {
            why,
            shown: shown.into(),
        }
    })?;
    if info.redis_settings().db() < 0 {
        return Err(E::NegativeDatabase(shown.into()));
    }
    Ok(())
}
