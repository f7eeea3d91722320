//! `GET /admin/`: the status page for a person (DESIGN §5). Hand-written HTML, CSS and
//! JavaScript embedded in the binary (`page/`), so it works with nothing fetched from anywhere;
//! its script refreshes it every 2 s from `/admin/routes` and `/admin/status`.
//!
//! With `TOLLGATE_ADMIN_TOKEN` set, a browser cannot send the Bearer header on a page load, so
//! `/admin/` without credentials answers 401 with a sign-in page: the token (typed in, or in
//! the URL's fragment `#token=…`, which browsers never send to a server) goes once to
//! `/admin/session` as a Bearer credential, and that answers with an HttpOnly, SameSite=Strict
//! session cookie derived from the token ([`AdminAuth`]), which the page and its fetches then
//! carry. The stylesheet and script hold no data and are served without credentials.

use bytes::Bytes;
use http_body_util::Full;
use hyper::{header, Response, StatusCode};

use super::token::AdminAuth;
use super::{json, Resp};

const PAGE: &str = include_str!("page/status.html");
const SIGN_IN: &str = include_str!("page/signin.html");
const SCRIPT: &str = include_str!("page/status.js");
const STYLE: &str = include_str!("page/status.css");

/// Nothing but the gateway's own files; no framing by other sites.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The answer to a request for `/admin/*` when a token is set, if it is not let through:
/// the sign-in page for the page itself, 401 for the rest. `/admin/session` is answered here.
pub fn gate(path: &str, headers: &http::HeaderMap, auth: &AdminAuth) -> Option<Resp> {
    match path {
        "/admin/status.js" | "/admin/status.css" => None,
        "/admin/session" if auth.bearer_ok(headers) => {
            let mut r = asset(StatusCode::NO_CONTENT, "text/plain", "");
            if let Ok(v) = auth.set_cookie().parse() {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            Some(r)
        }
        "/admin/session" => Some(unauthorized()),
        _ if auth.allows(headers) => None,
        "/admin/" => Some(asset(
            StatusCode::UNAUTHORIZED,
            "text/html; charset=utf-8",
            SIGN_IN,
        )),
        _ => Some(unauthorized()),
    }
}

fn unauthorized() -> Resp {
    json(
        StatusCode::UNAUTHORIZED,
        serde_json::json!({"error": "admin token required"}),
    )
}

/// The page and its files (the caller has let the request through).
pub fn serve(path: &str) -> Resp {
    match path {
        "/admin" => {
            let mut r = asset(StatusCode::PERMANENT_REDIRECT, "text/plain", "");
            r.headers_mut().insert(
                header::LOCATION,
                header::HeaderValue::from_static("/admin/"),
            );
            r
        }
        "/admin/status.js" => asset(StatusCode::OK, "text/javascript; charset=utf-8", SCRIPT),
        "/admin/status.css" => asset(StatusCode::OK, "text/css; charset=utf-8", STYLE),
        // Reached without a token set (with one, `gate` answered): no session to start.
        "/admin/session" => asset(StatusCode::NO_CONTENT, "text/plain", ""),
        _ => asset(StatusCode::OK, "text/html; charset=utf-8", PAGE),
    }
}

fn asset(status: StatusCode, content_type: &'static str, body: &'static str) -> Resp {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    r
}
