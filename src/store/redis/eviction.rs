//! tollgate's keys must never be evicted: an evicted budget is a full budget, an evicted lease
//! set a free slot. Every tollgate key has a TTL, so any `maxmemory-policy` but `noeviction`
//! (`allkeys-*` and `volatile-*` alike) can take them. At start and every minute the policy is
//! read; an unsafe one is logged as an ERROR and shown as `tollgate_store_eviction_unsafe 1`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::guard::Guard;
use super::RedisBackend;
use crate::store::StoreError;
use crate::telemetry::metrics;

/// How often the policy is read.
const CHECK_EVERY: Duration = Duration::from_secs(60);
/// How soon a check that could not read the policy (Redis down) is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// True for a policy that can evict a key with a TTL.
pub(super) fn evicts(policy: &str) -> bool {
    let p = policy.to_ascii_lowercase();
    p.starts_with("allkeys-") || p.starts_with("volatile-")
}

impl RedisBackend {
    /// Starts the policy check on a thread of its own, for as long as the store lives.
    pub(super) fn spawn_eviction_check(self: &Arc<Self>) {
        let store = Arc::downgrade(self);
        let spawned = crate::background::spawn("tollgate-eviction".into(), move || async move {
            check_forever(store).await;
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the maxmemory-policy check");
        }
    }

    /// Redis's `maxmemory-policy`.
    async fn eviction_policy(&self) -> Result<String, StoreError> {
        let within = self.timeout.max(Duration::from_millis(500));
        let got = self
            .guarded(Guard::Bypass(within), |mut conn| async move {
                let mut cmd = redis::cmd("CONFIG");
                cmd.arg("GET").arg("maxmemory-policy");
                Ok(cmd.query_async::<Vec<String>>(&mut conn).await?)
            })
            .await?;
        got.get(1)
            .cloned()
            .ok_or_else(|| StoreError::Reply(format!("CONFIG GET maxmemory-policy: {got:?}")))
    }
}

async fn check_forever(store: Weak<RedisBackend>) {
    let mut last: Option<String> = None;
    loop {
        let Some(s) = store.upgrade() else { return };
        let read = s.eviction_policy().await;
        drop(s);
        let pause = match read {
            Ok(policy) => {
                let unsafe_now = evicts(&policy);
                metrics().store_eviction_unsafe.set(unsafe_now as i64);
                if unsafe_now {
                    tracing::error!(policy = %policy, "Redis's maxmemory-policy can evict tollgate's keys (budgets and slots would reset silently): set it to noeviction");
                } else if last.as_deref().is_some_and(evicts) {
                    tracing::info!(policy = %policy, "Redis's maxmemory-policy no longer evicts tollgate's keys");
                }
                last = Some(policy);
                CHECK_EVERY
            }
            Err(e) => {
                // CONFIG may be renamed or refused (a managed Redis): said once, and the
                // gauge keeps its last reading.
                if matches!(&e, StoreError::Redis { .. }) && last.is_none() {
                    tracing::warn!(error = %e, "cannot read Redis's maxmemory-policy; make sure it is noeviction");
                    last = Some(String::new());
                }
                if last.is_some() {
                    CHECK_EVERY
                } else {
                    RETRY_EVERY
                }
            }
        };
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::evicts;

    #[test]
    fn every_policy_but_noeviction_can_evict_tollgates_keys() {
        for p in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            assert!(evicts(p), "{p}");
        }
        assert!(!evicts("noeviction"));
    }
}
