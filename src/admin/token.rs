//! `TOLLGATE_ADMIN_TOKEN` as the admin listener accepts it (DESIGN §5): unset means no token;
//! a value shorter than 16 characters (an empty one too: a variable set from a secret that is
//! missing must not open `/admin/*`) or a placeholder left from an example (`CHANGE-ME`, the
//! value in `deploy/k8s/secret.yaml`) or one shorter string repeated (`passwordpassword`) is
//! refused at start rather than guarding `/admin/*` with something anyone can guess, and so
//! is one that no `Authorization` header could carry (spaces, control or non-ASCII
//! characters: it would lock everyone out). [`AdminAuth`] is how a request shows it: the
//! token as a Bearer credential, or a browser's session cookie.

use std::sync::Arc;

/// The fewest characters an admin token may have.
pub const MIN_CHARS: usize = 16;

/// Placeholders that are refused wherever they appear in a value (`CHANGE-ME-0123456789`,
/// `<your-admin-token>`), compared on its letters and digits alone, lower-cased. Each has 7
/// letters or more, so that a random token holds one by chance about never.
const PLACEHOLDER_PARTS: [&str; 13] = [
    "changeme",
    "changeit",
    "replaceme",
    "placeholder",
    "yourtoken",
    "youradmin",
    "yoursecret",
    "tokenhere",
    "secrethere",
    "inserttoken",
    "inserthere",
    "settoken",
    "example",
];

/// Words a guessable token is made of: a value that is only these and digits
/// (`password1234567890`, `default-admin-token`) is refused. Longest first where one begins
/// another.
const WEAK_WORDS: [&str; 16] = [
    "password", "passwd", "pass", "secret", "default", "admin", "token", "test", "tollgate",
    "qwerty", "letmein", "welcome", "key", "dummy", "sample", "todo",
];

/// Whether `letters` (a value's letters and digits, lower-cased) is made of [`WEAK_WORDS`] and
/// digits only, with a word among them (random digits alone are a token; an empty value is
/// too short, not a placeholder).
fn weak_only(mut letters: &str) -> bool {
    let mut words = false;
    while !letters.is_empty() {
        if letters.as_bytes()[0].is_ascii_digit() {
            letters = &letters[1..];
        } else if let Some(w) = WEAK_WORDS.iter().find(|w| letters.starts_with(**w)) {
            letters = &letters[w.len()..];
            words = true;
        } else {
            return false;
        }
    }
    words
}

/// Whether `value` is a placeholder: one holding a [`PLACEHOLDER_PARTS`] (`CHANGE-ME`,
/// `change_me`) or starting `todo`, an unrendered template (`<…>`, `${…}`, `{{…}}`), or made of
/// [`WEAK_WORDS`] and digits (`secret`, `password`, `TOKEN`).
fn is_placeholder(value: &str) -> bool {
    let letters: String = value
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    PLACEHOLDER_PARTS.iter().any(|p| letters.contains(p))
        || letters.starts_with("todo")
        || (value.starts_with('<') && value.ends_with('>'))
        || value.starts_with("${")
        || value.starts_with("{{")
        || weak_only(&letters)
}

/// Why the token is refused. The value itself is never part of the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadToken {
    #[error("TOLLGATE_ADMIN_TOKEN is a placeholder value: set a random token of at least {MIN_CHARS} characters (e.g. the output of `openssl rand -hex 32`)")]
    Placeholder,
    #[error("TOLLGATE_ADMIN_TOKEN is one shorter string repeated: set a random token of at least {MIN_CHARS} characters (e.g. the output of `openssl rand -hex 32`)")]
    Repeated,
    #[error("TOLLGATE_ADMIN_TOKEN is {0} characters long: an admin token needs at least {MIN_CHARS} (e.g. the output of `openssl rand -hex 32`); unset it for no token")]
    TooShort(usize),
    #[error("TOLLGATE_ADMIN_TOKEN has spaces, control or non-ASCII characters, which no Authorization header can carry: use visible ASCII (e.g. the output of `openssl rand -hex 32`)")]
    Unsendable,
}

/// Checks a token value (the variable is set).
pub fn check(value: &str) -> Result<Arc<str>, BadToken> {
    if !value.is_empty() && !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(BadToken::Unsendable);
    }
    if is_placeholder(value) {
        return Err(BadToken::Placeholder);
    }
    let chars = value.chars().count();
    if chars < MIN_CHARS {
        return Err(BadToken::TooShort(chars));
    }
    if repeats(value.as_bytes()) {
        return Err(BadToken::Repeated);
    }
    Ok(Arc::from(value))
}

/// Whether `v` is a shorter string said at least twice (and a part of it again):
/// `passwordpasswordpassword`, `aaaaaaaaaaaaaaaa`, `abcabcabcabcabca`. Its length hides how
/// little there is to guess; a random token of 16 or more characters is not one.
fn repeats(v: &[u8]) -> bool {
    (1..=v.len() / 2).any(|period| v[period..] == v[..v.len() - period])
}

/// The token from the environment, checked; `None` when the variable is not set.
pub fn from_env() -> Result<Option<Arc<str>>, BadToken> {
    match std::env::var_os("TOLLGATE_ADMIN_TOKEN") {
        Some(v) => match v.into_string() {
            Ok(v) => check(&v).map(Some),
            Err(_) => Err(BadToken::Unsendable),
        },
        None => Ok(None),
    }
}

/// The cookie that carries a browser's admin session (the status page's fetches).
pub const COOKIE: &str = "tollgate_admin";

/// What `/admin/*` accepts once a token is set: `Authorization: Bearer <token>`, or the
/// session cookie that `/admin/session` hands to a browser that showed the token. The cookie's
/// value is derived from the token (SHA-256 of a fixed prefix and the token), so the token
/// itself is never stored in a browser's cookie jar; a new token ends every session.
#[derive(Clone)]
pub struct AdminAuth {
    token: Arc<str>,
    session: Arc<str>,
}

impl std::fmt::Debug for AdminAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminAuth(..)")
    }
}

impl AdminAuth {
    pub fn new(token: Arc<str>) -> AdminAuth {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"tollgate-admin-session\0");
        h.update(token.as_bytes());
        let session = Arc::from(hex::encode(h.finalize()));
        AdminAuth { token, session }
    }

    /// True when the request carries the token as a Bearer credential.
    pub fn bearer_ok(&self, headers: &http::HeaderMap) -> bool {
        headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .is_some_and(|given| constant_time_eq(given.as_bytes(), self.token.as_bytes()))
    }

    /// True when the request carries the token, or a browser's session cookie.
    pub fn allows(&self, headers: &http::HeaderMap) -> bool {
        self.bearer_ok(headers)
            || cookie(headers, COOKIE)
                .is_some_and(|v| constant_time_eq(v.as_bytes(), self.session.as_bytes()))
    }

    /// The `Set-Cookie` value that starts a browser session: only for `/admin/`, only sent
    /// to this origin (`SameSite=Strict`), out of scripts' reach, gone with the browser.
    pub fn set_cookie(&self) -> String {
        format!(
            "{COOKIE}={}; Path=/admin/; HttpOnly; SameSite=Strict",
            self.session
        )
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie<'h>(headers: &'h http::HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim())
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is case-insensitive
/// (RFC 9110 §11.1).
fn bearer_token(v: &str) -> Option<&str> {
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals() {
        for t in [
            "CHANGE-ME",
            "changeme",
            "Change_Me",
            "REPLACE-ME",
            "Secret",
            "password",
            "TOKEN",
        ] {
            assert_eq!(check(t), Err(BadToken::Placeholder), "{t}");
        }
        for t in ["CHANGE-ME-0123456789abcdef", "xxchangemexx-0123456789"] {
            assert_eq!(check(t), Err(BadToken::Placeholder), "{t}");
        }
        // What a probe started a gateway with: templates' placeholders, and values made of
        // guessable words and digits.
        for t in [
            "<your-admin-token>",
            "PLACEHOLDER-TOKEN-123",
            "REPLACE_ME_REPLACE_ME1",
            "TODO-set-a-real-token",
            "insert-token-here-123",
            "your-token-here-please",
            "changeit-changeit",
            "example-token-0000",
            "default-admin-token",
            "password1234567890",
            "Secret1234567890",
            "${TOLLGATE_ADMIN_TOKEN}",
            "{{admin_token}}",
        ] {
            assert_eq!(check(t), Err(BadToken::Placeholder), "{t}");
        }
        // Random tokens pass, whatever letters they happen to hold.
        for t in [
            "0123456789abcdef",
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            "tK3Qz8sV0pL6wR2yN5mB",
            "admin-9f86d081884c7d65",
            "84120937561029384756120398475610",
        ] {
            assert!(check(t).is_ok(), "{t}");
        }
        assert_eq!(check("admintok"), Err(BadToken::TooShort(8)));
        assert_eq!(check("0123456789abcde"), Err(BadToken::TooShort(15)));
        assert!(check("0123456789abcdef").is_ok());
        // Set but empty (a missing secret) does not open the admin API.
        assert_eq!(check(""), Err(BadToken::TooShort(0)));
        for t in [
            "                    ",
            " 0123456789abcdef",
            "0123456789\tabcdefgh",
            "ééééééééééééééééé",
        ] {
            assert_eq!(check(t), Err(BadToken::Unsendable), "{t:?}");
        }
        // (A guessable word said again and again is a placeholder first.)
        assert_eq!(
            check("passwordpasswordpassword"),
            Err(BadToken::Placeholder)
        );
        for t in [
            "xpasswordxpasswordxpassword",
            "aaaaaaaaaaaaaaaa",
            "abcabcabcabcabcab",
            "0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(check(t), Err(BadToken::Repeated), "{t}");
        }
        // Not repeated: once and a part (less than twice) is not a repetition.
        assert!(check("0123456789abcdef0123").is_ok());
        assert!(check("abcdefghabcdefghX").is_ok());
        let e = check("s3cret-admin").unwrap_err().to_string();
        assert!(!e.contains("s3cret-admin"), "{e}");
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc "), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    /// The token or the session cookie let a request in; the cookie is not the token, and a
    /// cookie of another name or value does not.
    #[test]
    fn bearer_or_session_cookie() {
        let token = "0123456789abcdef-admin";
        let auth = AdminAuth::new(Arc::from(token));
        let with = |name: http::header::HeaderName, v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(name, v.parse().unwrap());
            h
        };
        assert!(auth.allows(&with(
            http::header::AUTHORIZATION,
            &format!("Bearer {token}")
        )));
        let set = auth.set_cookie();
        assert!(!set.contains(token), "{set}");
        let pair = set.split(';').next().unwrap();
        assert!(auth.allows(&with(http::header::COOKIE, &format!("a=b; {pair}"))));
        assert!(!auth.bearer_ok(&with(http::header::COOKIE, pair)));
        for bad in [
            format!("{COOKIE}={token}"),
            format!("other={}", &pair[COOKIE.len() + 1..]),
            format!("{COOKIE}="),
        ] {
            assert!(!auth.allows(&with(http::header::COOKIE, &bad)), "{bad}");
        }
        assert!(!auth.allows(&http::HeaderMap::new()));
    }
}
