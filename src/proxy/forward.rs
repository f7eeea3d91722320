//! What the upstream receives: the peer to connect to, and the request as the gateway charged
//! it (normalized origin-form target; its method made canonical on the client's side already,
//! `proxy::decide`) with the forwarding headers.

use http::header::{AUTHORIZATION, HOST};
use http::{HeaderName, HeaderValue};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::{Error, ErrorType};

use super::ctx::Ctx;
use crate::config::{Config, IdentitySource};

// Looked up by these (parsed once), not by `&str` names, which `http` parses on every lookup.
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Removes `name` if the request has it: a lookup is one hash, a removal two (Pingora keeps
/// the header names' case in a second map).
fn remove_if_present(upstream: &mut RequestHeader, name: &HeaderName) -> Option<HeaderValue> {
    if upstream.headers.contains_key(name) {
        upstream.remove_header(name)
    } else {
        None
    }
}

/// What the upstream learns about the caller: the credential itself only with
/// `forward_credentials`, and the key's id in `key_id_header` (never a copy the client sent).
fn identity_headers(upstream: &mut RequestHeader, ctx: &Ctx, cfg: &Config) -> Result<()> {
    if !cfg.forward_credentials {
        for s in &cfg.sources {
            match s {
                IdentitySource::Header(name) => remove_if_present(upstream, name),
                IdentitySource::Bearer => remove_if_present(upstream, &AUTHORIZATION),
            };
        }
    }
    if let Some(name) = &cfg.key_id_header {
        remove_if_present(upstream, name);
        if let Some(id) = &ctx.identity {
            upstream.insert_header(name.clone(), &*id.log_name())?;
        }
    }
    Ok(())
}

/// `strip_prefix`: `/greenhouse/v1/boards?x` → `/v1/boards?x`, `/greenhouse` → `/`. Only whole
/// leading segments are removed (`/greenhousex` is left alone), matched as the route was: ASCII
/// case ignored, and a segment's matrix parameters (`/greenhouse;v=2/…`) going with it.
fn strip_prefix(upstream: &mut RequestHeader, prefix: &str) -> Result<()> {
    let target = upstream.uri.path_and_query().map_or("/", |p| p.as_str());
    let Some(stripped) = without_prefix(target, prefix) else {
        return Ok(());
    };
    let uri = stripped
        .parse::<http::Uri>()
        .map_err(|e| Error::because(ErrorType::InternalError, "stripped uri", e))?;
    upstream.set_uri(uri);
    Ok(())
}

/// `target` (a path and query) without the leading segments of `prefix`; None when they do
/// not lead it.
fn without_prefix(target: &str, prefix: &str) -> Option<String> {
    let (path, query) = match target.find('?') {
        Some(i) => target.split_at(i),
        None => (target, ""),
    };
    let mut rest = path;
    for want in prefix.split('/').skip(1) {
        let after = rest.strip_prefix('/')?;
        let (segment, tail) = after.split_at(after.find('/').unwrap_or(after.len()));
        let bare = segment.split(';').next().unwrap_or(segment);
        if !bare.eq_ignore_ascii_case(want) {
            return None;
        }
        rest = tail;
    }
    Some(format!(
        "{}{query}",
        if rest.is_empty() { "/" } else { rest }
    ))
}

/// `X-Forwarded-For` and `X-Forwarded-Proto`: only what a trusted proxy forwarded is passed
/// on (identity.trusted_proxies).
fn forwarded_for(
    upstream: &mut RequestHeader,
    ctx: &Ctx,
    received: &http::HeaderMap,
    tls: bool,
) -> Result<()> {
    let ours = HeaderValue::from_static(if tls { "https" } else { "http" });
    match &ctx.origin {
        Some(origin) => {
            upstream.insert_header("X-Forwarded-For", origin.forwarded_for(received))?;
            let proto = match origin
                .trusted_peer
                .then(|| received.get(&X_FORWARDED_PROTO))
                .flatten()
            {
                Some(p) => p.clone(),
                None => ours,
            };
            upstream.insert_header("X-Forwarded-Proto", proto)?;
        }
        None => {
            remove_if_present(upstream, &X_FORWARDED_FOR);
            upstream.insert_header("X-Forwarded-Proto", ours)?;
        }
    }
    Ok(())
}

/// A `Content-Length` that repeats one length — in one line (`2, 2`) or on several lines
/// (`3` and `03`), which Pingora reads as that length — as the single value the upstream must
/// get (RFC 9110 §8.6: an upstream that refuses the repetition would have been charged for
/// a request it never ran); `None` for one plain value, or any other.
fn one_length<'a>(values: impl Iterator<Item = &'a HeaderValue>) -> Option<HeaderValue> {
    let mut length = None;
    let mut repeated = false;
    for (i, v) in values.enumerate() {
        for part in v.as_bytes().split(|b| *b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let n: u64 = std::str::from_utf8(part).ok()?.parse().ok()?;
            repeated |= i > 0 || length.is_some();
            match length {
                Some(l) if l != n => return None,
                _ => length = Some(n),
            }
        }
    }
    length.filter(|_| repeated).map(HeaderValue::from)
}

/// Rewrites the upstream request: what was charged is what is sent. `received` are the
/// client's headers as they arrived; `tls`: the client connection is TLS.
pub fn request(
    upstream: &mut RequestHeader,
    ctx: &Ctx,
    received: &http::HeaderMap,
    tls: bool,
) -> Result<()> {
    // HTTP/2 has no Host header: its `:authority` is the host the client asked for.
    let authority = upstream
        .uri
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok());
    if let Some(f) = &ctx.forward {
        if let Some(target) = &f.forward_target {
            let uri = target
                .parse::<http::Uri>()
                .map_err(|e| Error::because(ErrorType::InternalError, "normalized uri", e))?;
            upstream.set_uri(uri);
        }
    }
    if let Some(prefix) = ctx
        .route
        .as_ref()
        .and_then(|r| r.provider.strip_prefix.clone())
    {
        strip_prefix(upstream, &prefix)?;
    }
    if let Some(one) = one_length(
        upstream
            .headers
            .get_all(http::header::CONTENT_LENGTH)
            .iter(),
    ) {
        upstream.insert_header(http::header::CONTENT_LENGTH, one)?;
    }
    if let Some(running) = &ctx.running {
        // The Host the client sent to us, replacing any X-Forwarded-Host it sent itself.
        remove_if_present(upstream, &X_FORWARDED_HOST);
        let host = ctx
            .upstream
            .host
            .clone()
            .unwrap_or_else(|| running.config.upstream.host_header.clone());
        // Replaced where it stands (an insert over an existing name neither removes nor
        // grows either of Pingora's two maps).
        let client_host = upstream.headers.get(&HOST).cloned();
        upstream.insert_header(HOST, host)?;
        if let Some(sent) = client_host.or(authority) {
            upstream.append_header("X-Forwarded-Host", sent)?;
        }
        identity_headers(upstream, ctx, &running.config)?;
        let trusted_peer = ctx.origin.is_some_and(|o| o.trusted_peer);
        super::scrub::scrub(upstream, &running.config, trusted_peer);
    }
    forwarded_for(upstream, ctx, received, tls)?;
    if let Some(id) = &ctx.request_id {
        // The client's own id is kept where it stands when it was believed (and is the only
        // one); otherwise the id the gateway logged replaces whatever was sent.
        let mut sent = upstream.headers.get_all(&X_REQUEST_ID).iter();
        let kept = matches!((sent.next(), sent.next()),
            (Some(v), None) if v.as_bytes() == id.as_bytes());
        if !kept {
            upstream.insert_header("X-Request-Id", id.as_str())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::without_prefix;

    #[test]
    fn a_prefix_is_stripped_as_the_route_was_matched() {
        for (target, want) in [
            ("/gh/repos/x?q=1", Some("/repos/x?q=1")),
            ("/gh", Some("/")),
            ("/gh?q=1", Some("/?q=1")),
            ("/GH/repos/x", Some("/repos/x")),
            ("/gh;x=1/a", Some("/a")),
            ("/Gh;v=2", Some("/")),
            ("/ghx/a", None),
            ("/g/h", None),
            ("/", None),
        ] {
            assert_eq!(without_prefix(target, "/gh").as_deref(), want, "{target}");
        }
        assert_eq!(without_prefix("/a;m=1/B/c", "/a/b").as_deref(), Some("/c"));
        assert_eq!(without_prefix("/a/bc/d", "/a/b"), None);
    }
}
