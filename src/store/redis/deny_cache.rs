//! Refusals without a round trip: keys Redis just refused as over budget.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::budget::{Limit, Outcome, Verdict};
use crate::store::{lock, short_key, AdmitRequest};

const DENY_SHARDS: usize = 32;

/// Keys that Redis refused as over budget, with the moment Redis said they could next fit.
///
/// Safe because it can only refuse, never admit: until `until`, the bucket cannot have room for
/// `cost` units — levels only fall with time, and other instances can only add to them. A
/// refund elsewhere could make room a little sooner; the cache then refuses a little longer
/// than needed, never shorter. A config change invalidates an entry (its `Limit` differs).
#[derive(Debug)]
pub(super) struct DenyCache {
    shards: Box<[Mutex<crate::store::KeyMap<DenyEntry>>]>,
}

#[derive(Debug, Clone, Copy)]
struct DenyEntry {
    until: Instant,
    cost: u64,
    limit: Limit,
    remaining: u64,
    reset_at: Instant,
}

impl DenyCache {
    pub(super) fn new() -> Self {
        DenyCache {
            shards: (0..DENY_SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    pub(super) fn check(&self, req: &AdmitRequest) -> Option<Outcome> {
        // A request on several budgets is refused by Redis only: which one refused, and every
        // one's figures, are not kept here.
        if !req.also.is_empty() {
            return None;
        }
        let k = short_key(&req.key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        let e = *shard.get(&k)?;
        let now = Instant::now();
        if now >= e.until || e.limit != req.limit {
            shard.remove(&k);
            return None;
        }
        // A dearer request fits later: by the extra units' drain time.
        let extra_us = (req.cost.saturating_sub(e.cost))
            .saturating_mul(req.limit.per_unit)
            .div_ceil(req.limit.rate);
        (req.cost >= e.cost).then(|| Outcome {
            verdict: Verdict::Reject {
                retry_after_us: (e.until - now).as_micros() as u64 + extra_us,
            },
            state: None,
            remaining: e.remaining,
            reset_us: e.reset_at.saturating_duration_since(now).as_micros() as u64,
            each: Default::default(),
        })
    }

    /// This instance just charged the key (a cheaper request fitted): the cached figures are
    /// stale, so the next refusal is Redis's to make.
    pub(super) fn forget(&self, key: &crate::identity::KeyHash) {
        let k = short_key(key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        if !shard.is_empty() {
            shard.remove(&k);
        }
    }

    pub(super) fn insert(&self, req: &AdmitRequest, o: &Outcome) {
        let Verdict::Reject { retry_after_us } = o.verdict else {
            return;
        };
        if !req.also.is_empty() {
            return;
        }
        let now = Instant::now();
        let k = short_key(&req.key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        if shard.len() > 10_000 {
            shard.retain(|_, e| e.until > now);
        }
        shard.insert(
            k,
            DenyEntry {
                until: now + Duration::from_micros(retry_after_us),
                cost: req.cost,
                limit: req.limit,
                remaining: o.remaining,
                reset_at: now + Duration::from_micros(o.reset_us),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn deny_cache_only_refuses_until_redis_said() {
        let c = DenyCache::new();
        let req = AdmitRequest {
            key: [1; 32],
            limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
            also: vec![],
            cost: 20,
            key_cap: None,
            route: Arc::from("r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        assert!(c.check(&req).is_none());
        let o = Outcome {
            verdict: Verdict::Reject {
                retry_after_us: 50_000,
            },
            state: None,
            remaining: 5,
            reset_us: 60_000_000,
            each: Default::default(),
        };
        c.insert(&req, &o);
        assert!(c.check(&req).is_some());
        // A cheaper request might fit sooner: not cached.
        let cheap = AdmitRequest {
            cost: 1,
            ..req.clone()
        };
        assert!(c.check(&cheap).is_none());
        // A different limit (reload): not cached.
        let other = AdmitRequest {
            limit: Limit::new(600, Duration::from_secs(60), Duration::ZERO).unwrap(),
            ..req.clone()
        };
        assert!(c.check(&other).is_none());
        c.insert(&req, &o);
        assert!(c.check(&req).is_some());
        std::thread::sleep(Duration::from_millis(60));
        assert!(c.check(&req).is_none(), "expired");
    }
}
