//! What an endpoint key must be for the router to ever select it.
//!
//! Requests are classified by their *normalized* path (`route::normalize_path`), so a pattern
//! is only useful written in that form, and only if it holds nothing a request path can never
//! hold. The router itself checks the template syntax (matchit) and conflicts.

use crate::route::{decode_delims, normalize_path, split_pattern, BadPath};

/// Placeholders for `{name}` / `{*name}` while the literal parts are normalized: the escapes
/// of two private-use characters, which normalization keeps as they are.
const OPEN: &str = "%EE%80%80";
const CLOSE: &str = "%EE%80%81";

/// Why the router could never select an endpoint (or, for one, the form to write instead).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum EndpointError {
    #[error("can never match: a CONNECT request names host:port, not a path, and is refused as bad-path")]
    Connect,
    #[error("can never match: {0}, and such requests are refused (400 bad-path) before routing")]
    BadPath(BadPath),
    #[error("can never match: {why}", why = unsendable(*.0))]
    Unsendable(char),
    #[error("can never match: requests are matched without matrix parameters (';' and what follows it in a segment)")]
    Matrix,
    #[error(
        "is not in normalized form, which is what requests are matched in: write \"{written}\""
    )]
    NotNormalized { written: String },
    /// The jobs' prefix itself, or a path under it, in any case.
    #[error("can never match: {prefix}<id> is an async job's own path, answered by the gateway before routing (never forwarded)", prefix = crate::jobs::PATH_PREFIX)]
    JobPath,
}

/// Why a request path is never matched with `c` as it is.
fn unsendable(c: char) -> String {
    match c {
        '?' => "a request path cannot contain '?' (it starts the query string, which is not part of the path)".to_string(),
        '#' => "a request path cannot contain '#' (it starts a fragment, which clients never send)".to_string(),
        c => format!(
            "requests are matched with '{c}' percent-encoded, as a path must hold it (one spelling for both); write %{:02X}",
            c as u32
        ),
    }
}

/// `Ok` for a pattern the router can select; otherwise why not, with the form to write.
pub(super) fn check_endpoint(pattern: &str) -> Result<(), EndpointError> {
    let (method, path) = split_pattern(pattern);
    if method == Some("CONNECT") {
        return Err(EndpointError::Connect);
    }
    // One space between the method and the path: the pattern is the route's name in metrics
    // and logs, written one way.
    let spaced = method.is_some_and(|m| pattern.len() != m.len() + 1 + path.len());
    if !path.starts_with('/') {
        // The router says so, with the same words as for any other path.
        return Ok(());
    }
    let Some((masked, params)) = mask_params(path) else {
        // Unbalanced braces: the router reports the template error.
        return Ok(());
    };
    // Before normalizing, which would escape them (`route::normalize_path`).
    if let Some(c) = masked.chars().find(|c| {
        matches!(
            c,
            ' ' | '#' | '?' | '"' | '<' | '>' | '^' | '`' | '{' | '|' | '}' | '[' | ']'
        )
    }) {
        return Err(EndpointError::Unsendable(c));
    }
    let normalized = normalize_path(&masked).map_err(EndpointError::BadPath)?;
    if normalized.contains(';') {
        return Err(EndpointError::Matrix);
    }
    // Written unescaped: a request with the escape is refused unless it is the same route
    // either way (`route::decode_delims`); one without would miss the endpoint.
    let normalized = match decode_delims(&normalized) {
        Some(d) => std::borrow::Cow::Owned(d),
        None => normalized,
    };
    if normalized != masked || spaced {
        let mut written = unmask_params(&normalized, &params);
        if let Some(m) = method {
            written = format!("{m} {written}");
        }
        return Err(EndpointError::NotNormalized { written });
    }
    // The jobs' prefix and every path under it, in any case, are the gateway's, whatever the
    // method (`proxy::jobs::job_in`).
    let prefix = crate::jobs::PATH_PREFIX.trim_end_matches('/');
    let under = path
        .get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
        && matches!(path.as_bytes().get(prefix.len()), None | Some(b'/'));
    if under {
        return Err(EndpointError::JobPath);
    }
    Ok(())
}

/// Replaces each `{…}` of a matchit template by a placeholder (`{{` and `}}` are literal
/// braces). `None` when the braces do not pair up.
fn mask_params(path: &str) -> Option<(String, Vec<&str>)> {
    let mut masked = String::with_capacity(path.len());
    let mut params = Vec::new();
    let mut rest = path;
    while let Some(pos) = rest.find(['{', '}']) {
        masked.push_str(&rest[..pos]);
        let tail = &rest[pos..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            masked.push_str(&tail[..2]);
            rest = &tail[2..];
        } else if tail.starts_with('{') {
            let end = tail.find('}')?;
            masked.push_str(OPEN);
            masked.push_str(&params.len().to_string());
            masked.push_str(CLOSE);
            params.push(&tail[..=end]);
            rest = &tail[end + 1..];
        } else {
            return None;
        }
    }
    masked.push_str(rest);
    Some((masked, params))
}

fn unmask_params(masked: &str, params: &[&str]) -> String {
    let mut out = masked.to_string();
    for (i, p) in params.iter().enumerate() {
        out = out.replace(&format!("{OPEN}{i}{CLOSE}"), p);
    }
    out
}
