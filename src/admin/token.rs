//! `TOLLGATE_ADMIN_TOKEN` as the admin listener accepts it (DESIGN §5): unset (or empty) means
//! no token; a value shorter than 16 characters or a placeholder left from an example
//! (`CHANGE-ME`, the value in `deploy/k8s/secret.yaml`) is refused at start rather than
//! guarding `/admin/*` with something anyone can guess.

use std::sync::Arc;

/// The fewest characters an admin token may have.
pub const MIN_CHARS: usize = 16;

/// Values from examples and templates, compared ignoring ASCII case.
const PLACEHOLDERS: [&str; 7] = [
    "change-me",
    "changeme",
    "change_me",
    "replace-me",
    "secret",
    "password",
    "token",
];

/// Placeholders that are refused wherever they appear in a value (`CHANGE-ME-0123456789`).
const PLACEHOLDER_PARTS: [&str; 5] = [
    "change-me",
    "changeme",
    "change_me",
    "replace-me",
    "replaceme",
];

/// Why the token is refused. The value itself is never part of the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadToken {
    #[error("TOLLGATE_ADMIN_TOKEN is a placeholder value: set a random token of at least {MIN_CHARS} characters (e.g. the output of `openssl rand -hex 32`)")]
    Placeholder,
    #[error("TOLLGATE_ADMIN_TOKEN is {0} characters long: an admin token needs at least {MIN_CHARS} (e.g. the output of `openssl rand -hex 32`)")]
    TooShort(usize),
}

/// Checks a token value; `Ok(None)` for an empty one (no token).
pub fn check(value: &str) -> Result<Option<Arc<str>>, BadToken> {
    if value.is_empty() {
        return Ok(None);
    }
    let lower = value.to_ascii_lowercase();
    if PLACEHOLDERS.contains(&lower.as_str()) || PLACEHOLDER_PARTS.iter().any(|p| lower.contains(p))
    {
        return Err(BadToken::Placeholder);
    }
    let chars = value.chars().count();
    if chars < MIN_CHARS {
        return Err(BadToken::TooShort(chars));
    }
    Ok(Some(Arc::from(value)))
}

/// The token from the environment, checked.
pub fn from_env() -> Result<Option<Arc<str>>, BadToken> {
    match std::env::var("TOLLGATE_ADMIN_TOKEN") {
        Ok(v) => check(&v),
        Err(_) => Ok(None),
    }
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
        assert_eq!(check("admintok"), Err(BadToken::TooShort(8)));
        assert_eq!(check("0123456789abcde"), Err(BadToken::TooShort(15)));
        assert!(check("0123456789abcdef").unwrap().is_some());
        assert_eq!(check(""), Ok(None));
        let e = check("s3cret-admin").unwrap_err().to_string();
        assert!(!e.contains("s3cret-admin"), "{e}");
    }
}
