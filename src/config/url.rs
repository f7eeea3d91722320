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
pub(super) fn parse_upstream_url(url: &str) -> Result<(bool, String, u16), String> {
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
