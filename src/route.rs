//! Which route a request is, and so what it costs.
//!
//! Two steps, both pure: [`normalize_path`] turns the request path into the one canonical form
//! that is both classified and forwarded (so `/reports//generate`, `/x/../reports/generate` and
//! `/reports/%67enerate` cannot dodge a cost), and [`Router::classify`] finds the most specific
//! endpoint pattern for it.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::policy::Budget;

pub mod stated;

/// One endpoint of `rate_limits.endpoints`, as validated by the config.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// The key as written in gateway.yaml: `PATH` or `METHOD PATH`.
    pub pattern: String,
    pub cost: u64,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    pub fidelity: Fidelity,
    pub provider: Provider,
}

/// How faithfully a route's cost is applied (DESIGN §6): whether its refusals are enforced or
/// only counted, and whether measured upstream time is billed on top of the admission cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fidelity {
    /// `mode: shadow`: budget and cap refusals are counted and described, never enforced.
    pub shadow: bool,
    /// `cost_per_second`: the final charge is `max(cost, ceil(upstream_s × this))`.
    pub cost_per_second: Option<f64>,
    /// `cost_from_response`: the response header in which the upstream states the request's
    /// real cost; the final charge becomes it (see [`stated`]).
    pub cost_from_response: Option<http::HeaderName>,
}

impl Fidelity {
    /// The total charge of a request admitted at `cost` whose upstream took `upstream`.
    pub fn final_cost(&self, cost: u64, upstream: Option<Duration>) -> u64 {
        match (self.cost_per_second, upstream) {
            (Some(rate), Some(d)) => {
                // The config bounds `rate` (≤ 1e6/s), so this is far below u64::MAX.
                let billed = (d.as_secs_f64() * rate).ceil();
                cost.max(billed as u64)
            }
            _ => cost,
        }
    }
}

/// What a route that calls a provider adds (DESIGN §1): the provider's own cap, shared by
/// every caller fleet-wide.
#[derive(Debug, Clone, Default)]
pub struct Provider {
    /// `shared:`: one budget for all callers of the route, charged with the caller's own.
    pub shared: Option<Budget>,
    /// `upstream:`: the named upstream to forward to (`None`: the default `upstream`).
    pub upstream: Option<Arc<str>>,
    /// `strip_prefix:`: removed from the path before forwarding.
    pub strip_prefix: Option<Arc<str>>,
}

/// A route the gateway classifies requests into. Plain data: the running gateway keeps the
/// route's metric series (`telemetry::RouteMetricsTable`), so parsing a config touches nothing
/// global.
#[derive(Debug)]
pub struct Route {
    /// Stable across reloads: the pattern as written, or `default`. Used as the metrics label
    /// and as the identity of the route's in-flight slots.
    pub label: Arc<str>,
    /// Position in [`Router::routes`] (file order, `default` last).
    pub index: usize,
    pub cost: u64,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    pub fidelity: Fidelity,
    pub provider: Provider,
}

impl Route {
    fn new(
        label: &str,
        index: usize,
        cost: u64,
        max_in_flight: Option<u32>,
        queue_timeout: Duration,
        fidelity: Fidelity,
        provider: Provider,
    ) -> Arc<Route> {
        Arc::new(Route {
            label: Arc::from(label),
            index,
            cost,
            max_in_flight,
            queue_timeout,
            fidelity,
            provider,
        })
    }

    /// The route's shared budget, if it has one.
    pub fn shared(&self) -> Option<&Budget> {
        self.provider.shared.as_ref()
    }
}

/// Why a path cannot be classified safely (→ 400 `bad-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadPath {
    #[error("the path must start with '/'")]
    NotAbsolute,
    #[error("the path contains an encoded '/' or '\\'")]
    EncodedSeparator,
    #[error("the path contains a backslash")]
    Backslash,
    #[error("the path contains a NUL or control character")]
    ControlChar,
    #[error("the path contains an invalid percent-encoding")]
    BadEncoding,
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Canonical form of a request path (no query):
/// - percent-encoded unreserved characters are decoded, other escapes are upper-cased;
/// - encoded `/` or `\`, backslashes, NUL and control characters are refused;
/// - `//` collapses, `.` and `..` segments resolve (never above the root);
/// - a trailing `/` is dropped (`/reports/generate/` is `/reports/generate`).
pub fn normalize_path(path: &str) -> Result<Cow<'_, str>, BadPath> {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(BadPath::NotAbsolute);
    }
    if is_canonical(bytes) {
        // The common case: nothing to decode, refuse or resolve, and no allocation.
        return Ok(Cow::Borrowed(path));
    }
    // Pass 1: decode what may be decoded, refuse what can't be classified.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'%' => {
                let (Some(h), Some(l)) = (
                    bytes.get(i + 1).copied().and_then(hex_val),
                    bytes.get(i + 2).copied().and_then(hex_val),
                ) else {
                    return Err(BadPath::BadEncoding);
                };
                let v = h << 4 | l;
                if v == b'/' || v == b'\\' {
                    return Err(BadPath::EncodedSeparator);
                }
                if v < 0x20 || v == 0x7f {
                    return Err(BadPath::ControlChar);
                }
                if is_unreserved(v) {
                    decoded.push(v);
                } else {
                    decoded.extend_from_slice(&[
                        b'%',
                        bytes[i + 1].to_ascii_uppercase(),
                        bytes[i + 2].to_ascii_uppercase(),
                    ]);
                }
                i += 3;
            }
            b'\\' => return Err(BadPath::Backslash),
            0..=0x1f | 0x7f => return Err(BadPath::ControlChar),
            _ => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    // Pass 2: resolve segments.
    let mut out: Vec<&[u8]> = Vec::new();
    for seg in decoded.split(|&b| b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    let mut s = String::with_capacity(decoded.len());
    if out.is_empty() {
        s.push('/');
    }
    for seg in out {
        s.push('/');
        // Only ASCII bytes were decoded; the rest came from a valid &str.
        s.push_str(std::str::from_utf8(seg).map_err(|_| BadPath::BadEncoding)?);
    }
    Ok(Cow::Owned(s))
}

/// True when `normalize_path` would return the path unchanged: no escapes, backslashes or
/// control characters, no empty, `.` or `..` segment, no trailing `/`.
fn is_canonical(bytes: &[u8]) -> bool {
    let mut prev = 0u8;
    // Dots since the last '/', or -1 once the segment has another byte: a segment of exactly
    // one or two dots is `.` or `..`.
    let mut dots = 0;
    for &b in bytes {
        match b {
            b'%' | b'\\' | 0..=0x1f | 0x7f => return false,
            b'/' => {
                if prev == b'/' || dots == 1 || dots == 2 {
                    return false;
                }
                dots = 0;
            }
            b'.' if dots >= 0 => dots += 1,
            _ => dots = -1,
        }
        prev = b;
    }
    !(dots == 1 || dots == 2 || (prev == b'/' && bytes.len() > 1))
}

/// How specific a pattern is: exact > template > tail, then more literal characters, then a
/// METHOD match beats a method-less one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Specificity {
    kind: u8,
    literal_len: usize,
    has_method: bool,
}

fn specificity(path: &str, has_method: bool) -> Specificity {
    let kind = if path.contains("{*") {
        0
    } else if path.contains('{') {
        1
    } else {
        2
    };
    let mut literal_len = 0;
    let mut depth = 0;
    for c in path.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ if depth == 0 => literal_len += 1,
            _ => {}
        }
    }
    Specificity {
        kind,
        literal_len,
        has_method,
    }
}

#[derive(Clone)]
struct Table {
    router: matchit::Router<usize>,
}

/// The endpoint table: one matcher for method-less patterns, one per method.
#[derive(Clone)]
pub struct Router {
    routes: Vec<(Arc<Route>, Specificity)>,
    any: Table,
    by_method: Vec<(String, Table)>,
    default: Arc<Route>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("routes", &self.routes.len())
            .finish()
    }
}

/// The result of classifying a request.
#[derive(Debug, Clone, Copy)]
pub struct Classified<'a> {
    pub route: &'a Arc<Route>,
}

/// An endpoint key, `PATH` or `METHOD PATH`, split into its method and path.
pub fn split_pattern(pattern: &str) -> (Option<&str>, &str) {
    match pattern.split_once(' ') {
        Some((m, p)) => (Some(m), p.trim_start()),
        None => (None, pattern),
    }
}

impl Router {
    /// Builds the table; errors are `(pattern, message)`.
    pub fn new(specs: Vec<RouteSpec>, default_cost: u64) -> Result<Router, Vec<(String, String)>> {
        Self::with_default(specs, default_cost, Fidelity::default())
    }

    /// [`Router::new`] with the `default` route's fidelity (`rate_limits.mode`).
    pub fn with_default(
        specs: Vec<RouteSpec>,
        default_cost: u64,
        default_fidelity: Fidelity,
    ) -> Result<Router, Vec<(String, String)>> {
        let mut errs = Vec::new();
        let mut routes = Vec::new();
        let mut any = matchit::Router::new();
        let mut by_method: Vec<(String, matchit::Router<usize>)> = Vec::new();
        for spec in specs {
            let (method, path) = split_pattern(&spec.pattern);
            if let Some(m) = method {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
                    errs.push((
                        spec.pattern.clone(),
                        format!("expected \"METHOD /path\" with an upper-case method, got \"{m}\""),
                    ));
                    continue;
                }
            }
            if let Err(m) = check_pattern(path) {
                errs.push((spec.pattern.clone(), m));
                continue;
            }
            let key = path.to_ascii_lowercase();
            let idx = routes.len();
            let table = match method {
                None => &mut any,
                Some(m) => {
                    let pos = match by_method.iter().position(|(name, _)| name == m) {
                        Some(p) => p,
                        None => {
                            by_method.push((m.to_string(), matchit::Router::new()));
                            by_method.len() - 1
                        }
                    };
                    &mut by_method[pos].1
                }
            };
            if let Err(e) = table.insert(key, idx) {
                errs.push((
                    spec.pattern.clone(),
                    format!("conflicts with another endpoint: {e}"),
                ));
                continue;
            }
            routes.push((
                Route::new(
                    &spec.pattern,
                    idx,
                    spec.cost,
                    spec.max_in_flight,
                    spec.queue_timeout,
                    spec.fidelity,
                    spec.provider.clone(),
                ),
                specificity(path, method.is_some()),
            ));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let default = Route::new(
            "default",
            routes.len(),
            default_cost,
            None,
            Duration::ZERO,
            default_fidelity,
            Provider::default(),
        );
        Ok(Router {
            routes,
            any: Table { router: any },
            by_method: by_method
                .into_iter()
                .map(|(m, router)| (m, Table { router }))
                .collect(),
            default,
        })
    }

    /// Finds the route of a *normalized* path. Matching ignores ASCII case, so that an upstream
    /// that does not care about case cannot be reached at a cheaper price.
    pub fn classify(&self, method: &str, path: &str) -> Classified<'_> {
        let lowered;
        let key = if path.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = path.to_ascii_lowercase();
            lowered.as_str()
        } else {
            path
        };
        let mut best: Option<usize> = self.any.router.at(key).ok().map(|m| *m.value);
        if let Some((_, t)) = self.by_method.iter().find(|(m, _)| m == method) {
            if let Ok(m) = t.router.at(key) {
                let cand = *m.value;
                best = match best {
                    Some(b) if self.routes[b].1 > self.routes[cand].1 => Some(b),
                    _ => Some(cand),
                };
            }
        }
        Classified {
            route: best.map(|i| &self.routes[i].0).unwrap_or(&self.default),
        }
    }

    /// The default route (no endpoint matched).
    pub fn default_route(&self) -> &Arc<Route> {
        &self.default
    }

    /// Every configured route, in file order, then `default`.
    pub fn routes(&self) -> impl Iterator<Item = &Route> {
        self.routes
            .iter()
            .map(|(r, _)| &**r)
            .chain(std::iter::once(&*self.default))
    }
}

fn check_pattern(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!("the path must start with '/', got \"{path}\""));
    }
    let inner = &path[1..];
    if !inner.is_empty() {
        for seg in inner.split('/') {
            if seg.is_empty() || seg == "." || seg == ".." {
                return Err(format!(
                    "the path must be normalized (no empty, '.' or '..' segments, no trailing '/'), got \"{path}\""
                ));
            }
        }
    }
    match normalize_path(&path.replace(['{', '}', '*'], "x")).map(|_| ()) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("{e}: \"{path}\"")),
    }
}

#[cfg(test)]
mod tests;
