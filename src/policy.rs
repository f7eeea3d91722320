//! A budget as the gateway applies it: the default one or a plan's, with its GCRA parameters
//! and the header values that describe it.
//!
//! Its own module because both the config (which builds policies) and the problem responses
//! (which describe them) need it; living in either made the two import each other.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::budget::Limit;

/// A budget: the default one, or a plan's. A plan with several budgets (`budgets:`) is charged
/// against all of them; `max_cost`, `window`, `limit` and `headers` are then its first one's,
/// and `budgets` lists every one.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `default` or the plan's name.
    pub name: String,
    pub max_cost: u64,
    pub window: Duration,
    pub max_delay: Duration,
    pub max_in_flight_per_key: Option<u32>,
    /// Its share of a full capped route's slots (`weight`, default 1; DESIGN §8).
    pub weight: u32,
    /// The GCRA parameters derived from the fields above.
    pub limit: Limit,
    /// Its `RateLimit-Policy` (every budget's member) and `X-RateLimit-Limit` values,
    /// formatted once.
    pub headers: PolicyHeaders,
    /// Every budget, the first one first; one entry for a plan of one budget.
    pub budgets: Vec<Budget>,
    /// The budgets after the first, as the store is asked to charge them.
    pub also: Vec<Extra>,
}

/// One budget of a policy.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Its name in the headers: the plan's when it has one budget, else `<plan>-<name>`.
    pub name: String,
    pub max_cost: u64,
    pub window: Duration,
    pub limit: Limit,
    pub headers: PolicyHeaders,
}

/// The name of a route's `shared` budget in the rate-limit headers.
pub const SHARED_BUDGET: &str = "shared";

impl Budget {
    pub fn new(name: &str, max_cost: u64, window: Duration, limit: Limit) -> Budget {
        Budget {
            name: name.to_string(),
            max_cost,
            window,
            limit,
            headers: PolicyHeaders::new(name, max_cost, window),
        }
    }

    /// One of `n` instances' share of this budget, as `on_error: local` enforces it.
    pub fn share(&self, n: u32) -> Budget {
        let limit = self.limit.fraction(n);
        Budget::new(&self.name, limit.max_cost(), self.window, limit)
    }
}

impl Policy {
    /// A policy of `budgets` (at least one): `(name within the plan, max_cost, window, limit)`.
    pub fn new(
        name: &str,
        budgets: Vec<(Option<String>, u64, Duration, Limit)>,
        max_delay: Duration,
        max_in_flight_per_key: Option<u32>,
    ) -> Option<Policy> {
        let several = budgets.len() > 1;
        let budgets: Vec<(Option<String>, Budget)> = budgets
            .into_iter()
            .map(|(inner, max_cost, window, limit)| {
                let shown = match (&inner, several) {
                    (Some(n), true) => format!("{name}-{n}"),
                    _ => name.to_string(),
                };
                (inner, Budget::new(&shown, max_cost, window, limit))
            })
            .collect();
        let also = budgets
            .iter()
            .skip(1)
            .map(|(inner, b)| Extra {
                bucket: Bucket::Key(Arc::from(inner.as_deref().unwrap_or(&b.name))),
                limit: b.limit,
            })
            .collect();
        let budgets: Vec<Budget> = budgets.into_iter().map(|(_, b)| b).collect();
        Policy::of(name, budgets, also, max_delay, max_in_flight_per_key)
    }

    /// One of `n` instances' share of every budget (`on_error: local`), for the headers that
    /// describe a decision made on it.
    pub fn share(&self, n: u32) -> Policy {
        let budgets = self.budgets.iter().map(|b| b.share(n)).collect();
        let also = self.also.iter().map(|e| e.fraction(n)).collect();
        Policy::of(
            &self.name,
            budgets,
            also,
            self.max_delay,
            self.max_in_flight_per_key,
        )
        .unwrap_or_else(|| self.clone())
    }

    /// The policy of `budgets` (at least one), the first one's figures at the top and one
    /// `RateLimit-Policy` member per budget.
    fn of(
        name: &str,
        budgets: Vec<Budget>,
        also: Vec<Extra>,
        max_delay: Duration,
        max_in_flight_per_key: Option<u32>,
    ) -> Option<Policy> {
        let first = budgets.first()?;
        let mut headers = first.headers.clone();
        if budgets.len() > 1 {
            let list: Vec<&str> = budgets
                .iter()
                .filter_map(|b| b.headers.policy.to_str().ok())
                .collect();
            headers.policy = HeaderValue::from_str(&list.join(", "))
                .unwrap_or_else(|_| HeaderValue::from_static(""));
        }
        Some(Policy {
            name: name.to_string(),
            max_cost: first.max_cost,
            window: first.window,
            max_delay,
            max_in_flight_per_key,
            weight: 1,
            limit: first.limit,
            headers,
            budgets,
            also,
        })
    }
}

/// A policy's header values that never change: `RateLimit-Policy` and `X-RateLimit-Limit`.
#[derive(Debug, Clone)]
pub struct PolicyHeaders {
    /// The policy name as a structured-field string, e.g. `"default"`.
    pub quoted_name: String,
    pub policy: HeaderValue,
    pub limit: HeaderValue,
}

impl PolicyHeaders {
    /// Policy names are plan names, which the config restricts to letters, digits, `-`, `_`
    /// and `.`; anything else is replaced all the same, so both headers always agree.
    pub fn new(name: &str, max_cost: u64, window: Duration) -> PolicyHeaders {
        let window = window.as_millis().div_ceil(1000).max(1);
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() && c != '"' && c != '\\' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let quoted_name = format!("\"{safe}\"");
        let policy = format!("{quoted_name};q={max_cost};w={window}");
        PolicyHeaders {
            quoted_name,
            policy: HeaderValue::from_str(&policy).unwrap_or_else(|_| HeaderValue::from_static("")),
            limit: HeaderValue::from(max_cost),
        }
    }
}

/// One more budget a request is charged against, besides the first (`store::AdmitRequest::limit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extra {
    pub bucket: Bucket,
    pub limit: Limit,
}

impl Extra {
    /// One of `n` instances' share of it (`on_error: local`).
    pub fn fraction(&self, n: u32) -> Extra {
        Extra {
            bucket: self.bucket.clone(),
            limit: self.limit.fraction(n),
        }
    }
}

/// Where an extra budget's state lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// Another budget of the key's plan, by its name within the plan.
    Key(Arc<str>),
    /// The `shared` budget of a route (by its label): every caller of the route draws from it.
    Route(Arc<str>),
}

/// Plan `pro` of two budgets, `minute` and `day`, for unit tests.
#[cfg(test)]
pub fn minute_and_day(per_minute: u64, per_day: u64) -> Policy {
    let (m, d) = (Duration::from_secs(60), Duration::from_secs(86_400));
    let budget = |name: &str, max_cost, window| {
        let limit = Limit::new(max_cost, window, Duration::ZERO).expect("a valid test budget");
        (Some(name.to_string()), max_cost, window, limit)
    };
    Policy::new(
        "pro",
        vec![budget("minute", per_minute, m), budget("day", per_day, d)],
        Duration::ZERO,
        None,
    )
    .expect("a valid test plan")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `w` is whole seconds, rounded up: a sub-second window says 1, never 0.
    #[test]
    fn policy_header_rounds_the_window_up() {
        let policy = |ms| PolicyHeaders::new("shared", 1, Duration::from_millis(ms)).policy;
        assert_eq!(policy(500), "\"shared\";q=1;w=1");
        assert_eq!(policy(1500), "\"shared\";q=1;w=2");
        assert_eq!(policy(60_000), "\"shared\";q=1;w=60");
    }
}
