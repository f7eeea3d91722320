//! Which route a request is, and so what it costs.
//!
//! Two steps, both pure: [`normalize_path`] turns the request path into the one canonical form
//! that is both classified and forwarded (so `/reports//generate`, `/x/../reports/generate` and
//! `/reports/%67enerate` cannot dodge a cost), and [`Router::classify`] finds the most specific
//! endpoint pattern for it.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::Budget;

mod path;
pub mod stated;
pub use path::{decode_delims, fold_to_ascii, match_path, normalize_path, BadPath};

/// One endpoint of `rate_limits.endpoints`, as validated by the config.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// The key as written in gateway.yaml: `PATH` or `METHOD PATH`.
    pub pattern: String,
    pub cost: u64,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    pub queue: QueueRules,
    pub fidelity: Fidelity,
    pub provider: Provider,
    /// `async:`: requests may become jobs (DESIGN §8); only on a capped route.
    pub jobs: Option<AsyncRules>,
}

/// `async:` on a capped endpoint, as validated: when a request becomes a job, and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncRules {
    /// `when: always`: every request is a job; else only one that asks
    /// (`Prefer: respond-async`).
    pub always: bool,
    /// How long a finished job's response is kept.
    pub result_ttl: Duration,
    /// A larger request body is refused (413, not charged).
    pub max_request_body: u64,
    /// A larger upstream answer ends the job failed (502, charged).
    pub max_response_body: u64,
}

/// How a capped route's fair queue is bounded (DESIGN §8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueRules {
    /// `max_queue`: most waiters, fleet-wide; beyond, 503 `route-busy` at once.
    pub max_queue: Option<u32>,
    /// `max_in_flight_per_key`: one key's share of the slots; beyond it, its requests wait.
    pub per_key: Option<u32>,
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

    /// The final charge of a request admitted at `cost`: what its upstream stated
    /// (`cost_from_response`), else [`Fidelity::final_cost`] of its time.
    pub fn charge(
        &self,
        cost: u64,
        upstream: Option<Duration>,
        report: Option<stated::Report>,
    ) -> u64 {
        match report {
            Some(stated::Report::Applied(units)) => units,
            _ => self.final_cost(cost, upstream),
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
    /// Position in [`Router::routes`] (the order of the patterns as strings, `default` last).
    pub index: usize,
    pub cost: u64,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    pub queue: QueueRules,
    pub fidelity: Fidelity,
    pub provider: Provider,
    pub jobs: Option<AsyncRules>,
    /// When its config was loaded (ms since the Unix epoch): of two configs' caps for the
    /// route's queue, the later loaded holds (a reload elsewhere in the fleet, or a request
    /// decided just before this instance's reload, must not undo a newer one).
    pub loaded_ms: u64,
}

impl Route {
    fn new(spec: &RouteSpec, label: &str, index: usize, loaded_ms: u64) -> Arc<Route> {
        Arc::new(Route {
            loaded_ms,
            label: Arc::from(label),
            index,
            cost: spec.cost,
            max_in_flight: spec.max_in_flight,
            queue_timeout: spec.queue_timeout,
            queue: spec.queue,
            fidelity: spec.fidelity.clone(),
            provider: spec.provider.clone(),
            jobs: spec.jobs,
        })
    }

    /// The route's shared budget, if it has one.
    pub fn shared(&self) -> Option<&Budget> {
        self.provider.shared.as_ref()
    }
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

/// One set of patterns (method-less, or one method's): exact paths and templates in one
/// matcher, tails (`{*rest}`) in another, since a matcher refuses a template and a tail
/// under the same prefix (`/files/{id}`, `/files/{*path}`) while DESIGN §1 ranks them:
/// exact > template > tail, so a tail is only looked up when nothing else matches.
#[derive(Clone, Default)]
struct Table {
    plain: matchit::Router<usize>,
    tails: matchit::Router<usize>,
}

impl Table {
    /// `Err(Ok(key))`: it conflicts with the pattern inserted as `key`; `Err(Err(why))`: the
    /// matcher takes no such pattern.
    fn insert(&mut self, key: String, idx: usize) -> Result<(), Result<String, String>> {
        let router = match key.contains("{*") {
            true => &mut self.tails,
            false => &mut self.plain,
        };
        router.insert(key, idx).map_err(|e| match e {
            matchit::InsertError::Conflict { with } => Ok(with),
            other => Err(format!("is not a pattern the router takes: {other}")),
        })
    }

    fn at(&self, key: &str) -> Option<usize> {
        self.plain
            .at(key)
            .or_else(|_| self.tails.at(key))
            .ok()
            .map(|m| *m.value)
    }
}

/// The endpoint table: one matcher for method-less patterns, one per method.
#[derive(Clone)]
pub struct Router {
    routes: Vec<(Arc<Route>, Specificity)>,
    any: Table,
    by_method: Vec<(String, Table)>,
    default: Arc<Route>,
    /// `rate_limits.match_suffixes`, lower-case: a path ending in one also matches without it.
    suffixes: Vec<Box<str>>,
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

/// The table of `method`'s patterns, added to `by_method` on first use.
fn method_table<'a>(by_method: &'a mut Vec<(String, Table)>, method: &str) -> &'a mut Table {
    let pos = match by_method.iter().position(|(name, _)| name == method) {
        Some(p) => p,
        None => {
            by_method.push((method.to_string(), Table::default()));
            by_method.len() - 1
        }
    };
    &mut by_method[pos].1
}

/// When a config is loaded, in ms since the Unix epoch, always after the last one loaded in
/// this process (a clock stepped back must not make a reload older than the config it
/// replaces).
fn load_stamp() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = crate::unix_ms();
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let stamp = now.max(last + 1);
        match LAST.compare_exchange_weak(last, stamp, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return stamp,
            Err(seen) => last = seen,
        }
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
        let loaded_ms = load_stamp();
        let mut errs = Vec::new();
        let mut routes = Vec::new();
        let mut any = Table::default();
        let mut by_method: Vec<(String, Table)> = Vec::new();
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
                errs.push((spec.pattern.clone(), m.to_string()));
                continue;
            }
            let key = path.to_ascii_lowercase();
            let idx = routes.len();
            let table = match method {
                None => &mut any,
                Some(m) => method_table(&mut by_method, m),
            };
            if let Err(e) = table.insert(key, idx) {
                // Named as written: the matcher knows the other only lower-cased, without its
                // method.
                let message = match e {
                    Ok(with) => {
                        let other = routes
                            .iter()
                            .map(|(r, _): &(Arc<Route>, Specificity)| &*r.label)
                            .find(|label| {
                                let (m, p) = split_pattern(label);
                                m == method && p.eq_ignore_ascii_case(&with)
                            })
                            .unwrap_or(with.as_str());
                        format!("conflicts with the endpoint \"{other}\"")
                    }
                    Err(why) => why,
                };
                errs.push((spec.pattern.clone(), message));
                continue;
            }
            routes.push((
                Route::new(&spec, &spec.pattern, idx, loaded_ms),
                specificity(path, method.is_some()),
            ));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let default = Route::new(
            &RouteSpec {
                pattern: "default".into(),
                cost: default_cost,
                max_in_flight: None,
                queue_timeout: Duration::ZERO,
                queue: QueueRules::default(),
                fidelity: default_fidelity,
                provider: Provider::default(),
                jobs: None,
            },
            "default",
            routes.len(),
            loaded_ms,
        );
        Ok(Router {
            routes,
            any,
            by_method,
            default,
            suffixes: Vec::new(),
        })
    }

    /// `rate_limits.match_suffixes` (validated: each starts with `.`).
    pub fn with_suffixes(mut self, suffixes: &[String]) -> Router {
        self.suffixes = suffixes
            .iter()
            .map(|s| s.to_ascii_lowercase().into_boxed_str())
            .collect();
        self
    }

    /// The route of a *normalized* path ([`normalize_path`]), as the gateway charges it:
    /// matched without matrix parameters ([`match_path`]); refused when a Unicode letter in it
    /// case-folds onto ASCII and the folded spelling is another route ([`fold_to_ascii`]), or
    /// when an escaped `:`, `@` or sub-delimiter unescaped spells another route
    /// ([`decode_delims`]): an upstream that decodes the path and one that does not would run
    /// two different handlers, and either could be the costlier.
    pub fn route_of(&self, method: &str, normalized: &str) -> Result<&Arc<Route>, BadPath> {
        let path = match_path(normalized)?;
        let route = self.classify(method, &path).route;
        if let Some(decoded) = decode_delims(&path) {
            if self.classify(method, &decoded).route.index != route.index {
                return Err(BadPath::EscapedDelimiter);
            }
        }
        if let Some(folded) = fold_to_ascii(&path) {
            if self.classify(method, &folded).route.index != route.index {
                return Err(BadPath::CaseFold);
            }
        }
        Ok(route)
    }

    /// Finds the route of a path as matched ([`match_path`]). Matching ignores ASCII case, so
    /// that an upstream that does not care about case cannot be reached at a cheaper price; a
    /// path ending in one of `match_suffixes` also matches without it (the more specific wins).
    pub fn classify(&self, method: &str, path: &str) -> Classified<'_> {
        let lowered;
        let key = if path.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = path.to_ascii_lowercase();
            lowered.as_str()
        } else {
            path
        };
        let mut best = self.lookup(method, key);
        if let Some(bare) = self.without_suffix(key) {
            best = self.more_specific(best, self.lookup(method, bare));
        }
        Classified {
            route: best.map(|i| &self.routes[i].0).unwrap_or(&self.default),
        }
    }

    /// `key` (lower-case) without the match suffix it ends in, if any; the last segment keeps
    /// at least one character.
    fn without_suffix<'k>(&self, key: &'k str) -> Option<&'k str> {
        if self.suffixes.is_empty() {
            return None;
        }
        let last = &key[key.rfind('/').map_or(0, |i| i + 1)..];
        self.suffixes
            .iter()
            .find(|s| last.len() > s.len() && last.ends_with(&***s))
            .map(|s| &key[..key.len() - s.len()])
    }

    /// The most specific endpoint that matches a lower-case path. A `HEAD` also matches the
    /// `GET` endpoints (frameworks run the GET handler for it), its own winning a tie.
    fn lookup(&self, method: &str, key: &str) -> Option<usize> {
        let any = self.any.at(key);
        let mut by_method = self.method_lookup(method, key);
        if method == "HEAD" {
            by_method = self.more_specific(self.method_lookup("GET", key), by_method);
        }
        self.more_specific(any, by_method)
    }

    /// The most specific of `method`'s own endpoints that matches a lower-case path.
    fn method_lookup(&self, method: &str, key: &str) -> Option<usize> {
        self.by_method
            .iter()
            .find(|(m, _)| m == method)
            .and_then(|(_, t)| t.at(key))
    }

    /// The more specific of two matches; `b` on a tie.
    fn more_specific(&self, a: Option<usize>, b: Option<usize>) -> Option<usize> {
        match (a, b) {
            (Some(a), Some(b)) if self.routes[a].1 > self.routes[b].1 => Some(a),
            (a, None) => a,
            (_, b) => b,
        }
    }

    /// The default route (no endpoint matched).
    pub fn default_route(&self) -> &Arc<Route> {
        &self.default
    }

    /// The endpoint whose label is `label` (an async job's route, found again after a reload).
    pub fn by_label(&self, label: &str) -> Option<&Arc<Route>> {
        self.routes
            .iter()
            .map(|(r, _)| r)
            .find(|r| &*r.label == label)
    }

    /// Every configured route, in the order of their patterns, then `default`.
    pub fn routes(&self) -> impl Iterator<Item = &Route> {
        self.routes
            .iter()
            .map(|(r, _)| &**r)
            .chain(std::iter::once(&*self.default))
    }
}

/// A reload, as the stores' queues take it at once: the routes now in force, and the routes
/// whose cap it took away, whose waiters go now, as the route's new requests do.
pub struct Reloaded<'a> {
    pub router: &'a Router,
    /// Routes still configured, with no cap now: their queue has none, fleet-wide (the
    /// newest config's figures, as for any change of cap).
    pub uncapped: Vec<Arc<str>>,
    /// Capped routes the reload took away (or renamed): this instance's own waiters go, but
    /// a fleet-wide queue keeps its cap for the instances that still have the route.
    pub gone: Vec<Arc<str>>,
}

impl<'a> Reloaded<'a> {
    pub fn new(old: &Router, router: &'a Router) -> Self {
        let capped_now: std::collections::HashMap<&str, bool> = router
            .routes()
            .map(|r| (&*r.label, r.max_in_flight.is_some()))
            .collect();
        let (mut uncapped, mut gone) = (vec![], vec![]);
        for r in old.routes().filter(|r| r.max_in_flight.is_some()) {
            match capped_now.get(&*r.label) {
                Some(true) => {}
                Some(false) => uncapped.push(r.label.clone()),
                None => gone.push(r.label.clone()),
            }
        }
        Reloaded {
            router,
            uncapped,
            gone,
        }
    }

    /// Every route whose waiters in this instance go now.
    pub fn released(&self) -> impl Iterator<Item = &Arc<str>> {
        self.uncapped.iter().chain(&self.gone)
    }

    /// When the new config was loaded (`Route::loaded_ms`): a queue keeps the newest figures.
    pub fn loaded_ms(&self) -> u64 {
        self.router.default_route().loaded_ms
    }
}

/// Why an endpoint's path can be no route; each quotes the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum PatternError {
    #[error("the path must start with '/', got \"{0}\"")]
    NotAbsolute(String),
    #[error("the path must be normalized (no empty, '.' or '..' segments, no trailing '/'), got \"{0}\"")]
    NotNormalized(String),
    #[error("{why}: \"{path}\"")]
    Unsafe { why: BadPath, path: String },
}

fn check_pattern(path: &str) -> Result<(), PatternError> {
    if !path.starts_with('/') {
        return Err(PatternError::NotAbsolute(path.into()));
    }
    let inner = &path[1..];
    if !inner.is_empty() {
        for seg in inner.split('/') {
            if seg.is_empty() || seg == "." || seg == ".." {
                return Err(PatternError::NotNormalized(path.into()));
            }
        }
    }
    match normalize_path(&path.replace(['{', '}', '*'], "x")).map(|_| ()) {
        Ok(_) => Ok(()),
        Err(why) => Err(PatternError::Unsafe {
            why,
            path: path.into(),
        }),
    }
}

#[cfg(test)]
mod tests;
