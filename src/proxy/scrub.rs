//! What of a client's headers the upstream must not believe (DESIGN §3 "Cost evasion"): headers
//! that make a framework run another method or path than the one charged, claims about the
//! client's address from a peer that is not a trusted proxy, other spellings of the credential
//! and of `key_id_header` (CGI-style servers fold `-` and `_` onto one variable), and request
//! ids that would bloat the log; and the names in a client's `Connection` header of headers
//! the gateway sets itself, which would make Pingora refuse the request.
//!
//! One pass over the header names, compared in place: a request that carries none of these
//! (nearly all) costs no allocation.

use http::{HeaderName, HeaderValue};
use pingora::http::RequestHeader;

use crate::config::{Config, IdentitySource};

/// Make the upstream run another method or path than the one the gateway classified.
const OVERRIDES: [&str; 5] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-url",
    "x-rewrite-url",
];

/// Claims about the client that only a trusted proxy may make: DESIGN §3's six, then the
/// other address headers frameworks and CDNs read (the upstream learns the client from
/// `X-Forwarded-For` only), and the claims of scheme and host besides the `X-Forwarded-Proto`
/// and `X-Forwarded-Host` the gateway sets (Rails's `X-Forwarded-Ssl`, `X-Url-Scheme`, …).
const CLAIMS: [&str; 20] = [
    "forwarded",
    "x-real-ip",
    "true-client-ip",
    "x-client-ip",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-original-forwarded-for",
    "x-forwarded",
    "x-remote-ip",
    "x-remote-addr",
    "x-forwarded-ssl",
    "x-forwarded-scheme",
    "x-url-scheme",
    "front-end-https",
    "x-forwarded-server",
    "x-original-host",
];

/// Set by the gateway itself (`forward::request`); a client's other spellings of them are claims.
const GATEWAY_SET: [&str; 3] = ["x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"];

/// Whether `name` (lower-case) is, in any spelling, a header the gateway sets on every request
/// it forwards (`X-Request-Id`, [`GATEWAY_SET`]): a client's copy is replaced or removed, so
/// no other meaning can travel in one (`config`: not a key source, not the key-id header).
pub(crate) fn set_by_gateway(name: &str) -> bool {
    let n = name.as_bytes();
    same_folded(n, b"x-request-id") || GATEWAY_SET.iter().any(|g| same_folded(n, g.as_bytes()))
}

/// `name` (lower-case, as `http` keeps header names) equals `want` when `-` and `_` are one.
fn same_folded(name: &[u8], want: &[u8]) -> bool {
    name.len() == want.len()
        && name
            .iter()
            .zip(want)
            .all(|(&a, &b)| a == b || (matches!(a, b'-' | b'_') && matches!(b, b'-' | b'_')))
}

/// `name` is another spelling of `want`: folded the same, written differently.
fn other_spelling(name: &[u8], want: &[u8]) -> bool {
    name != want && same_folded(name, want)
}

/// Whether the header `name` is removed before forwarding.
fn scrubbed(name: &str, cfg: &Config, trusted_peer: bool) -> bool {
    let n = name.as_bytes();
    if OVERRIDES.iter().any(|o| same_folded(n, o.as_bytes())) {
        return true;
    }
    // The request id is the gateway's to check (or make): `X_Request_Id` is the same variable
    // to a CGI-style server, and would bring the client's unchecked one beside it.
    if other_spelling(n, b"x-request-id") {
        return true;
    }
    if !trusted_peer
        && (CLAIMS.iter().any(|c| same_folded(n, c.as_bytes()))
            || GATEWAY_SET.iter().any(|g| other_spelling(n, g.as_bytes())))
    {
        return true;
    }
    let credential = cfg.sources.iter().any(|s| match s {
        IdentitySource::Header(h) => other_spelling(n, h.as_str().as_bytes()),
        IdentitySource::Bearer => false,
    });
    credential
        || cfg
            .key_id_header
            .as_ref()
            .is_some_and(|k| other_spelling(n, k.as_str().as_bytes()))
}

/// Removes every header the upstream must not believe. `trusted_peer`: the connection comes
/// from `identity.trusted_proxies`, whose address claims are passed on.
pub fn scrub(upstream: &mut RequestHeader, cfg: &Config, trusted_peer: bool) {
    let mut found: Option<Vec<HeaderName>> = None;
    for name in upstream.headers.keys() {
        if scrubbed(name.as_str(), cfg, trusted_peer) {
            found.get_or_insert_with(Vec::new).push(name.clone());
        }
    }
    for name in found.into_iter().flatten() {
        upstream.remove_header(&name);
    }
}

/// Headers the upstream request gets from the gateway itself (`forward::request`) and from
/// Pingora (`Host`), which Pingora refuses to see nominated by the client's `Connection`
/// header: it would fail the admitted request as malformed (400) and log an ERROR each time.
const SET_FOR_UPSTREAM: [&str; 4] = [
    "host",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

fn sets_for_upstream(token: &[u8]) -> bool {
    let token = token.trim_ascii();
    SET_FOR_UPSTREAM
        .iter()
        .any(|n| token.eq_ignore_ascii_case(n.as_bytes()))
}

/// An option no header could be named by (RFC 9110 §5.6.2: a token is `tchar`s; a quoted
/// name, one with a space, or `:authority` is not): Pingora refuses those as malformed too.
fn not_a_token(token: &[u8]) -> bool {
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    !token.trim_ascii().iter().all(tchar)
}

/// An option the client's `Connection` header is better without (see [`connection_options`]).
fn dropped(token: &[u8]) -> bool {
    sets_for_upstream(token) || not_a_token(token)
}

/// Drops [`SET_FOR_UPSTREAM`]'s names from the client's `Connection` header (the other
/// options it names are kept, and so still removed before forwarding, as hop-by-hop headers
/// are): a client that calls them hop-by-hop says nothing the gateway would not do anyway,
/// since it sets them on the upstream request itself. Options that are not tokens are
/// dropped too: they name no header (RFC 9110 allows ignoring them). A `Connection` that has
/// none of them (nearly all) costs no allocation; one left with no option is removed.
pub fn connection_options(req: &mut RequestHeader) -> pingora::Result<()> {
    let named = |v: &HeaderValue| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| !t.trim_ascii().is_empty() && dropped(t))
    };
    let values = req.headers.get_all(http::header::CONNECTION);
    if !values.iter().any(named) {
        return Ok(());
    }
    let mut kept: Vec<u8> = Vec::new();
    for token in values
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
    {
        let token = token.trim_ascii();
        if token.is_empty() || dropped(token) {
            continue;
        }
        if !kept.is_empty() {
            kept.extend_from_slice(b", ");
        }
        kept.extend_from_slice(token);
    }
    req.remove_header(&http::header::CONNECTION);
    if !kept.is_empty() {
        // Bytes of the client's own valid values, joined: valid too.
        let value = HeaderValue::from_bytes(&kept).map_err(|e| {
            pingora::Error::because(pingora::ErrorType::InvalidHTTPHeader, "connection", e)
        })?;
        req.insert_header(http::header::CONNECTION, value)?;
    }
    Ok(())
}

/// The longest client request id that is believed (and logged).
const MAX_REQUEST_ID: usize = 128;

/// A client's `X-Request-Id`, when it is one worth keeping: 1 to 128 of `[A-Za-z0-9._:-]`.
/// Anything else is replaced by a generated id (a 1 MB id would be written whole into the log).
pub fn client_request_id(v: &HeaderValue) -> Option<String> {
    let b = v.as_bytes();
    let fair = !b.is_empty()
        && b.len() <= MAX_REQUEST_ID
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-'));
    // All ASCII, so the conversion cannot fail.
    fair.then(|| String::from_utf8_lossy(b).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings() {
        assert!(same_folded(b"x_api_key", b"x-api-key"));
        assert!(same_folded(b"x-api_key", b"x-api-key"));
        assert!(!same_folded(b"x-api-keys", b"x-api-key"));
        assert!(!same_folded(b"xxapi-key", b"x-api-key"));
        assert!(!other_spelling(b"x-api-key", b"x-api-key"));
        assert!(other_spelling(b"x_forwarded_for", b"x-forwarded-for"));
    }

    #[test]
    fn connection_options_lose_only_what_the_gateway_sets() {
        let after = |values: &[&str]| {
            let mut req = RequestHeader::build("GET", b"/", None).unwrap();
            for v in values {
                req.append_header("Connection", *v).unwrap();
            }
            connection_options(&mut req).unwrap();
            let left: Vec<_> = req.headers.get_all("connection").iter().cloned().collect();
            left
        };
        assert_eq!(after(&["X-Forwarded-For"]), Vec::<HeaderValue>::new());
        assert_eq!(
            after(&["Host, X-FORWARDED-proto"]),
            Vec::<HeaderValue>::new()
        );
        assert_eq!(
            after(&["close, x-forwarded-host ,X-Hop", "Keep-Alive,host"]),
            ["close, X-Hop, Keep-Alive"]
        );
        // Untouched: nothing the gateway sets is named (no rewrite, no allocation).
        assert_eq!(after(&["keep-alive, X-Hop"]), ["keep-alive, X-Hop"]);
        assert_eq!(after(&["x-forwarded-fort"]), ["x-forwarded-fort"]);
        assert_eq!(after(&[]), Vec::<HeaderValue>::new());
    }

    #[test]
    fn request_ids() {
        let id = |s: &str| client_request_id(&HeaderValue::from_str(s).unwrap());
        assert_eq!(id("abc-123.x:y_z").as_deref(), Some("abc-123.x:y_z"));
        assert_eq!(id(&"a".repeat(128)).map(|s| s.len()), Some(128));
        assert_eq!(id(&"a".repeat(129)), None);
        assert_eq!(id(""), None);
        assert_eq!(id("a b"), None);
        assert_eq!(id("a/b"), None);
        assert_eq!(
            client_request_id(&HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()),
            None
        );
    }
}
