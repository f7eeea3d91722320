//! `tracing:` — where the gateway's OpenTelemetry spans go (DESIGN §9): the block as written,
//! and the settings it validates to. Without the block, or with an empty `otlp_endpoint`,
//! there are no settings and the gateway builds no spans at all.

use serde::{Deserialize, Serialize};

use super::bounds::{shown, MAX_NAME_CHARS};
use super::error::ConfigErrors;
use super::url::redact_url;

/// The block as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, expecting = "the tracing settings, a map")]
pub struct RawTracing {
    /// OTLP/HTTP (protobuf) collector: a base URL (`/v1/traces` is appended) or the full
    /// traces URL. Empty: no export.
    #[serde(default)]
    pub otlp_endpoint: String,
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// The share of new traces (requests without a sampled parent) that are recorded.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
}

fn default_service_name() -> String {
    "tollgate".into()
}

fn default_sample_ratio() -> f64 {
    1.0
}

/// Tracing as the gateway runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The URL spans are POSTed to (ends in `/v1/traces`).
    pub traces_url: String,
    pub service_name: String,
    pub sample_ratio: f64,
}

const TRACES_PATH: &str = "/v1/traces";

/// `tracing`: `None` when absent or switched off (an empty endpoint); every problem pushed
/// with its path.
pub(super) fn validate(t: Option<&RawTracing>, errs: &mut ConfigErrors) -> Option<TraceSettings> {
    let t = t?;
    let before = errs.0.len();
    if !(t.sample_ratio.is_finite() && (0.0..=1.0).contains(&t.sample_ratio)) {
        errs.push(
            "tracing.sample_ratio",
            format!("must be between 0 and 1, got {}", t.sample_ratio),
        );
    }
    let name = t.service_name.trim();
    if name.is_empty()
        || name.chars().count() > MAX_NAME_CHARS
        || name.chars().any(char::is_control)
    {
        errs.push(
            "tracing.service_name",
            format!(
                "must be 1 to {MAX_NAME_CHARS} printable characters, got \"{}\"",
                shown(&t.service_name).escape_debug()
            ),
        );
    }
    let url = if t.otlp_endpoint.is_empty() {
        None
    } else {
        traces_url(&t.otlp_endpoint)
            .map_err(|m| errs.push("tracing.otlp_endpoint", m.to_string()))
            .ok()
    };
    if errs.0.len() > before {
        return None;
    }
    Some(TraceSettings {
        traces_url: url?,
        service_name: name.to_string(),
        sample_ratio: t.sample_ratio,
    })
}

/// Why `tracing.otlp_endpoint` was refused; each quotes the URL redacted (`quoted`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum EndpointError {
    #[error("not a URL ({why}), got \"{quoted}\"")]
    NotAUrl {
        why: ::url::ParseError,
        quoted: String,
    },
    #[error("https:// is not supported yet: send to a collector (or an agent) over http://, got \"{0}\"")]
    Https(String),
    #[error("must start with http:// (OTLP/HTTP), got \"{0}\"")]
    Scheme(String),
    #[error("has no host, got \"{0}\"")]
    NoHost(String),
    #[error("credentials in the collector URL are not supported, got \"{0}\"")]
    Credentials(String),
    #[error("must not have a query or fragment, got \"{0}\"")]
    QueryOrFragment(String),
}

/// `http://host:4318` → `http://host:4318/v1/traces`; a URL that already ends in
/// `/v1/traces` (or `/v1/traces/`) is kept, without the slash.
fn traces_url(raw: &str) -> Result<String, EndpointError> {
    use EndpointError as E;
    // Errors quote the URL, redacted: a user:password@ part is a secret.
    let quoted = shown(&redact_url(raw));
    let url = ::url::Url::parse(raw).map_err(|why| E::NotAUrl {
        why,
        quoted: quoted.clone(),
    })?;
    if url.scheme() == "https" {
        return Err(E::Https(quoted));
    }
    if url.scheme() != "http" {
        return Err(E::Scheme(quoted));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(E::NoHost(quoted));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(E::Credentials(quoted));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(E::QueryOrFragment(quoted));
    }
    let mut url = url;
    // `…/v1/traces/` too is posted to `…/v1/traces`: a collector routes that exact path.
    let path = url.path().trim_end_matches('/').to_string();
    match path.ends_with(TRACES_PATH) {
        true => url.set_path(&path),
        false => url.set_path(&format!("{path}{TRACES_PATH}")),
    }
    Ok(url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(endpoint: &str, ratio: f64) -> Result<Option<TraceSettings>, Vec<String>> {
        let raw = RawTracing {
            otlp_endpoint: endpoint.into(),
            service_name: "tollgate".into(),
            sample_ratio: ratio,
        };
        let mut errs = ConfigErrors::default();
        let s = validate(Some(&raw), &mut errs);
        if errs.0.is_empty() {
            Ok(s)
        } else {
            Err(errs.0.iter().map(|e| e.to_string()).collect())
        }
    }

    #[test]
    fn the_traces_path_is_appended_once() {
        let url = |e| check(e, 1.0).unwrap().unwrap().traces_url;
        assert_eq!(
            url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(url("http://c/otel/"), "http://c/otel/v1/traces");
        assert_eq!(url("http://c/v1/traces"), "http://c/v1/traces");
        assert_eq!(url("http://c:4318/v1/traces/"), "http://c:4318/v1/traces");
        assert!(check("https://c:4318", 1.0).unwrap_err()[0]
            .starts_with("tracing.otlp_endpoint: https:// is not supported yet"));
    }

    #[test]
    fn an_empty_endpoint_is_off_and_bad_values_name_their_field() {
        assert_eq!(check("", 0.5), Ok(None));
        let errs = check("ftp://c", 1.5).unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert_eq!(
            errs[0],
            "tracing.sample_ratio: must be between 0 and 1, got 1.5"
        );
        assert!(errs[1].starts_with("tracing.otlp_endpoint: must start with http://"));
        let errs = check("http://u:secret@c:4318", f64::NAN).unwrap_err();
        assert!(errs.iter().all(|e| !e.contains("secret")), "{errs:?}");
        assert!(
            check("not a url", 1.0).unwrap_err()[0].starts_with("tracing.otlp_endpoint: not a URL")
        );
        // An empty endpoint with a bad ratio is still an error.
        assert!(check("", -0.1).is_err());
    }
}
