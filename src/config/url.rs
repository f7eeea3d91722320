//! The two URLs of gateway.yaml: the upstream's (`http[s]://host[:port]`) and the store's,
//! which may carry a password and so is shown only redacted.

/// `redis://user:secret@host` → `redis://user:***@host`.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
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
            format!("{}{}@{}", &url[..scheme_end + 3], redacted, &rest[at + 1..])
        }
    }
}

/// `http://host[:port][/]` or `https://…` → (tls, host, port).
pub(super) fn parse_upstream_url(raw: &str) -> Result<(bool, String, u16), String> {
    // Errors quote the URL, and a URL with user:pass@ carries a secret: quote it redacted.
    let shown = redact_url(raw);
    let url = shown.as_str();
    if raw.contains('@') {
        return Err(format!(
            "credentials in the upstream URL are not supported (send them from the upstream's side), got \"{url}\""
        ));
    }
    let url = raw;
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(format!(
            "must start with http:// or https://, got \"{url}\""
        ));
    };
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(format!(
            "expected scheme://host[:port] without a path, got \"{url}\""
        ));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let end = v6
            .find(']')
            .ok_or_else(|| format!("bad IPv6 address in \"{url}\""))?;
        let host = &v6[..end];
        let port = match &v6[end + 1..] {
            "" => default_port,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("bad port in \"{url}\""))?,
        };
        (host.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse().map_err(|_| format!("bad port in \"{url}\""))?,
            ),
            None => (authority.to_string(), default_port),
        }
    };
    if host.is_empty() {
        return Err(format!("missing host in \"{url}\""));
    }
    Ok((tls, host, port))
}

/// Reads `store.url` the way the Redis client will when the gateway runs, so that `check`
/// refuses a URL that `run` could never connect with. The error shows the URL only redacted.
pub(super) fn check_redis_url(url: &str) -> Result<(), String> {
    let shown = redact_url(url);
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    if scheme.ends_with("+cluster") || scheme.ends_with("+sentinel") {
        return Err(format!(
            "{scheme}:// (Redis {}) is not supported by this build; use redis:// or rediss:// (got \"{shown}\")",
            if scheme.ends_with("+cluster") { "Cluster" } else { "Sentinel" }
        ));
    }
    if scheme != "redis" && scheme != "rediss" {
        return Err(format!(
            "must start with redis:// or rediss:// (got \"{shown}\")"
        ));
    }
    let parsed = redis::parse_redis_url(url).ok_or_else(|| {
        // The same parser, asked again for its reason (parse_redis_url keeps it to itself).
        let why = ::url::Url::parse(url)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "not a URL".into());
        format!("cannot be parsed: {why} (got \"{shown}\")")
    })?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!("the host is missing (got \"{shown}\")"));
    }
    if parsed.port() == Some(0) {
        return Err(format!(
            "the port must be between 1 and 65535 (got \"{shown}\")"
        ));
    }
    let info = redis::IntoConnectionInfo::into_connection_info(parsed).map_err(|e| {
        // "Invalid database number - InvalidClientConfig": the part a user can act on.
        let e = e.to_string();
        let why = e.split(" - ").next().unwrap_or(&e).to_string();
        format!("cannot be used: {why} (got \"{shown}\")")
    })?;
    if info.redis_settings().db() < 0 {
        return Err(format!(
            "the database number must be 0 or more (got \"{shown}\")"
        ));
    }
    Ok(())
}
