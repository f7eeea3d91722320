//! `async:` on an endpoint (DESIGN §8): only a capped route may turn requests into jobs, since
//! a job is a waiter in the route's fair queue.

use std::time::Duration;

use crate::config::duration::format_duration;
use crate::config::error::ConfigErrors;
use crate::config::raw::{AsyncWhen, RawEndpoint};
use crate::config::size::format_size;
use crate::route::AsyncRules;

const DEFAULT_RESULT_TTL: Duration = Duration::from_secs(3600);
/// A finished job's response is kept at most a day (it holds memory, or Redis memory).
const MAX_RESULT_TTL: Duration = Duration::from_secs(24 * 3600);
const DEFAULT_MAX_REQUEST_BODY: u64 = 1 << 20;
const DEFAULT_MAX_RESPONSE_BODY: u64 = 16 << 20;
/// Bodies are held whole (in memory, or in Redis) while the job waits or its result is kept.
const MAX_REQUEST_BODY: u64 = 64 << 20;
const MAX_RESPONSE_BODY: u64 = 256 << 20;

/// The endpoint's `async:` block at `base`, checked; `None` when absent or invalid.
pub(super) fn async_rules(
    base: &str,
    e: &RawEndpoint,
    max_in_flight: Option<u32>,
    errs: &mut ConfigErrors,
) -> Option<AsyncRules> {
    let a = e.jobs.as_ref()?;
    let path = format!("{base}.async");
    let mut ok = true;
    if max_in_flight.is_none() {
        errs.push(
            path.clone(),
            "only a capped endpoint (with max_in_flight) may be async: a job waits in the route's queue",
        );
        ok = false;
    }
    let result_ttl = a.result_ttl.map_or(DEFAULT_RESULT_TTL, |d| d.0);
    if result_ttl < Duration::from_secs(1) || result_ttl > MAX_RESULT_TTL {
        errs.push(
            format!("{path}.result_ttl"),
            format!(
                "must be between 1s and 24h, got {}",
                format_duration(result_ttl)
            ),
        );
        ok = false;
    }
    let mut size = |field: &str, got: Option<u64>, default: u64, max: u64| {
        let n = got.unwrap_or(default);
        if n == 0 || n > max {
            errs.push(
                format!("{path}.{field}"),
                format!(
                    "must be between 1B and {}, got {}",
                    format_size(max),
                    format_size(n)
                ),
            );
            ok = false;
        }
        n
    };
    let max_request_body = size(
        "max_request_body",
        a.max_request_body.map(|s| s.0),
        DEFAULT_MAX_REQUEST_BODY,
        MAX_REQUEST_BODY,
    );
    let max_response_body = size(
        "max_response_body",
        a.max_response_body.map(|s| s.0),
        DEFAULT_MAX_RESPONSE_BODY,
        MAX_RESPONSE_BODY,
    );
    ok.then_some(AsyncRules {
        always: a.when == AsyncWhen::Always,
        result_ttl,
        max_request_body,
        max_response_body,
    })
}
