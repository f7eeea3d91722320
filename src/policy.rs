//! A budget as the gateway applies it: the default one or a plan's, with its GCRA parameters
//! and the header values that describe it.
//!
//! Its own module because both the config (which builds policies) and the problem responses
//! (which describe them) need it; living in either made the two import each other.

use std::time::Duration;

use http::HeaderValue;

use crate::budget::Limit;

/// A budget: the default one, or a plan's.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `default` or the plan's name; shown in `RateLimit-Policy`.
    pub name: String,
    pub max_cost: u64,
    pub window: Duration,
    pub max_delay: Duration,
    pub max_in_flight_per_key: Option<u32>,
    /// The GCRA parameters derived from the fields above.
    pub limit: Limit,
    /// Its `RateLimit-Policy` and `X-RateLimit-Limit` values, formatted once.
    pub headers: PolicyHeaders,
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
