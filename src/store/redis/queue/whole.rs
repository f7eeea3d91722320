//! A capped route's queue as a whole, not one request's way through it: a reload's cap and
//! per-key share put in force for its waiters, and what `/admin/routes` shows of it.

use std::sync::Arc;
use std::time::Duration;

use super::super::keys::{self, queue_keys};
use super::super::RedisBackend;
use super::GRANT_TTL;
use crate::store::StoreError;

/// How often a reload's `cap` is sent while Redis fails it, and how far apart.
const CAP_ATTEMPTS: u32 = 3;
const CAP_RETRY_AFTER: Duration = Duration::from_secs(1);

impl RedisBackend {
    /// A reload is in force: each capped route's queue takes the new cap and per-key share
    /// at once (`lua/queue.lua`, `cap`), so that the fleet's waiters get the slots a larger
    /// cap adds now, and a smaller cap holds them, not only from the route's next request;
    /// one whose cap the reload took away takes none, and its waiters go (128 a call, the rest
    /// at the route's next calls, each beat's among them). (One the reload took
    /// away whole keeps its cap: the instances not reloaded yet still serve it.)
    /// On a thread of its own (a reload may come from a thread without a runtime).
    pub(in crate::store::redis) fn reconfigure_queues(
        self: &Arc<Self>,
        reloaded: &crate::route::Reloaded,
    ) {
        let since = reloaded.loaded_ms();
        let caps: Vec<(String, u32, u32, u64)> = reloaded
            .router
            .routes()
            .filter_map(|r| {
                let share = r.queue.per_key.unwrap_or(0);
                Some((r.label.to_string(), r.max_in_flight?, share, r.loaded_ms))
            })
            .chain((reloaded.uncapped.iter()).map(|label| (label.to_string(), u32::MAX, 0, since)))
            .collect();
        if caps.is_empty() {
            return;
        }
        let store = self.clone();
        let spawned = crate::background::spawn("tollgate-reconfigure".into(), move || async move {
            // Once one route's calls all failed, the others are sent once each: a Redis that
            // is down does not hold the thread for seconds per route.
            let mut attempts = CAP_ATTEMPTS;
            for (route, cap, share, since) in caps {
                let Some(keys) = super::keys::queue_keys(&super::keys::route_slots_key(&route))
                else {
                    continue;
                };
                let mut inv = store.queue_script.call(&keys, "cap");
                inv.arg(cap)
                    .arg(share)
                    .arg(GRANT_TTL.as_micros() as u64)
                    .arg(since);
                // The same call twice writes the same figures: sent again while Redis fails
                // (a route that lost its cap has no request of the new config to carry them).
                let mut attempt = 1;
                while let Err(e) = store.call_repeatable::<Vec<i64>>(inv.clone()).await {
                    if attempt >= attempts {
                        attempts = 1;
                        tracing::warn!(%route, error = %e, "a reloaded cap did not reach Redis: the route's queue takes it with the next request of the new config");
                        break;
                    }
                    attempt += 1;
                    tokio::time::sleep(CAP_RETRY_AFTER).await;
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "reloaded caps reach each route's waiters with its next request");
        }
    }

    /// A capped route's slots and waiters, fleet-wide, as its queue holds them.
    pub async fn route_queue(
        &self,
        route: &str,
    ) -> Result<crate::store::fair::QueueView, StoreError> {
        use crate::store::fair::{KeyRef, KeyView, QueueView};
        let keys = queue_keys(&keys::route_slots_key(route))
            .ok_or_else(|| StoreError::Reply("route lease key".into()))?;
        let v: Vec<redis::Value> = self
            .call_repeatable(self.queue_script.call(&keys, "peek"))
            .await?;
        let int = |v: &redis::Value| redis::from_redis_value::<u64>(v.clone()).unwrap_or(0);
        let (running, queued) = (v.first().map_or(0, int), v.get(1).map_or(0, int));
        let keys = v
            .get(2..)
            .unwrap_or_default()
            .chunks(3)
            .filter_map(|c| {
                Some(KeyView {
                    key: KeyRef::Tag(redis::from_redis_value::<String>(c.first()?.clone()).ok()?),
                    running: int(c.get(1)?) as u32,
                    waiting: int(c.get(2)?) as usize,
                })
            })
            .collect();
        Ok(QueueView {
            route: Arc::from(route),
            running: running as u32,
            queued: queued as usize,
            keys,
        })
    }
}
