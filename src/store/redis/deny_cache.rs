//! Refusals without a round trip: keys Redis just refused as over budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::conn::SUBSCRIBE_AGAIN_AFTER;
use super::guard::Guard;
use super::{keys, RedisBackend};
use crate::budget::{Limit, Outcome, Verdict};
use crate::identity::KeyHash;
use crate::store::{lock, short_key, AdmitRequest, StoreError};

const DENY_SHARDS: usize = 32;

/// Where Redis says that units went back into an API key's budgets (a refund, an undone
/// admission, a slice's unspent units): the key's tag (`lua/store/extra.lua`'s `gave_back`).
pub(super) const GIVEN_BACK: &str = "tollgate:given-back";

/// Keys that Redis refused as over budget, with the moment Redis said they could next fit.
///
/// Until then the bucket cannot have room for `cost` units — levels only fall with time, and
/// other instances' admissions only add to them — unless units go back into it: a refund,
/// here or on another instance. Redis publishes every such give-back ([`GIVEN_BACK`]), and
/// every write-back of what another instance's fallback admitted (the refusal stays right,
/// but its moment comes later), and the instance forgets the key's refusal when it hears
/// it. So a refusal is kept only while this instance is subscribed, and one decided before
/// a message it heard (or before it subscribed) is not kept at all. A config change invalidates an entry (its `Limit` differs).
#[derive(Debug)]
pub(super) struct DenyCache {
    shards: Box<[Mutex<Shard>]>,
    /// µs after `epoch` since which the subscription stands; `u64::MAX` while there is none.
    live_since: AtomicU64,
    epoch: Instant,
}

#[derive(Debug, Default)]
struct Shard {
    entries: crate::store::KeyMap<DenyEntry>,
    /// The last give-back heard for a key of this shard: a refusal Redis decided before it
    /// may be stale by the time its reply arrives.
    heard: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct DenyEntry {
    key: u128,
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
            live_since: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
        }
    }

    fn shard(&self, bits: u64) -> std::sync::MutexGuard<'_, Shard> {
        lock(&self.shards[(bits as usize) % DENY_SHARDS])
    }

    pub(super) fn check(&self, req: &AdmitRequest) -> Option<Outcome> {
        // A request on several budgets is refused by Redis only: which one refused, and every
        // one's figures, are not kept here.
        if !req.also.is_empty() || self.live_since.load(Ordering::Relaxed) == u64::MAX {
            return None;
        }
        let bits = keys::tag_bits(&req.key);
        let mut shard = self.shard(bits);
        let e = *shard.entries.get(&u128::from(bits))?;
        let now = Instant::now();
        if now >= e.until || e.limit != req.limit || e.key != short_key(&req.key) {
            shard.entries.remove(&u128::from(bits));
            return None;
        }
        drop(shard);
        // A dearer request fits later: by the extra units' drain time.
        let extra_us = (req.cost.saturating_sub(e.cost))
            .saturating_mul(req.limit.per_unit)
            .div_ceil(req.limit.rate);
        let reset_us = e.reset_at.saturating_duration_since(now).as_micros() as u64;
        // What drained since: the units left at the highest level `reset_us` allows, never
        // fewer than Redis counted.
        let remaining = e
            .remaining
            .max(req.limit.remaining(reset_us.saturating_mul(req.limit.rate)));
        (req.cost >= e.cost).then(|| Outcome {
            verdict: Verdict::Reject {
                retry_after_us: (e.until - now).as_micros() as u64 + extra_us,
            },
            state: None,
            remaining,
            reset_us,
            each: Default::default(),
        })
    }

    /// This instance just charged or refunded the key: the cached figures are stale, so the
    /// next refusal is Redis's to make.
    pub(super) fn forget(&self, key: &KeyHash) {
        let bits = keys::tag_bits(key);
        let mut shard = self.shard(bits);
        if !shard.entries.is_empty() {
            shard.entries.remove(&u128::from(bits));
        }
    }

    /// Redis published that units went back to the key of `tag`, or that it was charged a debt.
    fn heard(&self, tag: &str) {
        let Some(bits) = keys::tag_bits_of(tag) else {
            return;
        };
        let mut shard = self.shard(bits);
        shard.heard = Some(Instant::now());
        shard.entries.remove(&u128::from(bits));
    }

    /// The subscription stands (from now) or is lost: what was kept may have missed a
    /// give-back, and nothing is kept until it stands again.
    fn linked(&self, live: bool) {
        self.live_since.store(u64::MAX, Ordering::Relaxed);
        for s in self.shards.iter() {
            lock(s).entries.clear();
        }
        if live {
            let since = self.epoch.elapsed().as_micros() as u64;
            self.live_since.store(since, Ordering::Relaxed);
        }
    }

    /// Keeps Redis's refusal of `req`, decided by a call sent at `sent`.
    pub(super) fn insert(&self, req: &AdmitRequest, o: &Outcome, sent: Instant) {
        let Verdict::Reject { retry_after_us } = o.verdict else {
            return;
        };
        let since = self.live_since.load(Ordering::Relaxed);
        if !req.also.is_empty()
            || since == u64::MAX
            || (sent.saturating_duration_since(self.epoch).as_micros() as u64) <= since
        {
            return;
        }
        let now = Instant::now();
        let bits = keys::tag_bits(&req.key);
        let mut shard = self.shard(bits);
        if shard.heard.is_some_and(|h| h >= sent) {
            return;
        }
        if shard.entries.len() > 10_000 {
            shard.entries.retain(|_, e| e.until > now);
        }
        shard.entries.insert(
            u128::from(bits),
            DenyEntry {
                key: short_key(&req.key),
                until: now + Duration::from_micros(retry_after_us),
                cost: req.cost,
                limit: req.limit,
                remaining: o.remaining,
                reset_at: now + Duration::from_micros(o.reset_us),
            },
        );
    }
}

/// How often an instance publishes its own heartbeat on [`GIVEN_BACK`].
const BEAT_EVERY: Duration = Duration::from_secs(1);
/// A subscription that has not heard the instance's own heartbeat for this long is taken for
/// deaf (a connection a middlebox dropped silently, a primary cut off from the fleet): the
/// cache stops keeping refusals and the instance subscribes anew.
const DEAF_AFTER: Duration = Duration::from_secs(3);

impl RedisBackend {
    /// Listens for give-backs ([`GIVEN_BACK`]) on a thread of its own, for as long as the
    /// store lives: the deny cache keeps refusals only while it hears them.
    pub(super) fn spawn_give_back_listener(self: &Arc<Self>) {
        let store = Arc::downgrade(self);
        let spawned = crate::background::spawn("tollgate-given-back".into(), move || listen(store));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot listen for refunds: every refusal asks Redis");
        }
    }

    /// Publishes `message` on [`GIVEN_BACK`] on this thread's connection, past the breaker.
    async fn publish_given_back(&self, message: String) -> Result<(), StoreError> {
        let within = self.timeout.max(Duration::from_millis(500));
        self.guarded(Guard::Bypass(within), |mut conn| async move {
            let mut cmd = redis::cmd("PUBLISH");
            cmd.arg(GIVEN_BACK).arg(message);
            Ok(cmd.query_async::<i64>(&mut conn).await?)
        })
        .await
        .map(drop)
    }
}

/// Subscribes to [`GIVEN_BACK`], anew whenever the subscription breaks or goes deaf.
async fn listen(store: Weak<RedisBackend>) {
    loop {
        let Some(beat) = store.upgrade().map(|s| format!("beat:{}", s.instance)) else {
            return;
        };
        let primary = super::conn::Primary::now(&store);
        if let Some(ps) = super::conn::subscribe(&store, GIVEN_BACK).await {
            hear(&store, ps, beat, &primary).await;
        }
        let Some(s) = store.upgrade() else { return };
        s.deny.linked(false);
        drop(s);
        if !primary.changed(&store) {
            // (A new primary is subscribed on at once.)
            tokio::time::sleep(SUBSCRIBE_AGAIN_AFTER).await;
        }
    }
}

/// Hears give-backs until the subscription ends or stops hearing the instance's own
/// heartbeat (published on the connection its calls use, so a beat heard proves that what
/// Redis publishes reaches this subscription). The cache keeps refusals from the first beat
/// heard.
async fn hear(
    store: &Weak<RedisBackend>,
    mut ps: redis::aio::PubSub,
    beat: String,
    primary: &super::conn::Primary,
) {
    use futures_util::StreamExt;
    let mut messages = ps.on_message();
    let mut tick = tokio::time::interval(BEAT_EVERY);
    let mut check = primary.checks();
    let (mut heard_beat, mut live) = (Instant::now(), false);
    loop {
        tokio::select! {
            msg = messages.next() => {
                let Some(msg) = msg else { return };
                let Some(s) = store.upgrade() else { return };
                let Ok(m) = msg.get_payload::<String>() else { continue };
                if m == beat {
                    heard_beat = Instant::now();
                    if !std::mem::replace(&mut live, true) {
                        s.deny.linked(true);
                    }
                } else {
                    s.deny.heard(&m);
                }
            }
            // Subscribed on a demoted primary: deaf to what the new one is sent.
            _ = check.tick(), if primary.named() => {
                if primary.changed(store) {
                    return;
                }
            }
            _ = tick.tick() => {
                if heard_beat.elapsed() > DEAF_AFTER {
                    tracing::debug!("the give-back subscription went deaf; subscribing anew");
                    return;
                }
                let Some(s) = store.upgrade() else { return };
                // On a task of its own: a slow Redis must not hold up the messages.
                let beat = beat.clone();
                tokio::spawn(async move { s.publish_given_back(beat).await });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn refusal(retry_after_us: u64) -> Outcome {
        Outcome {
            verdict: Verdict::Reject { retry_after_us },
            state: None,
            remaining: 5,
            reset_us: 60_000_000,
            each: Default::default(),
        }
    }

    fn request() -> AdmitRequest {
        AdmitRequest {
            key: [1; 32],
            limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
            also: vec![],
            cost: 20,
            key_cap: None,
            route: Arc::from("r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        }
    }

    #[test]
    fn deny_cache_only_refuses_until_redis_said() {
        let c = DenyCache::new();
        c.linked(true);
        std::thread::sleep(Duration::from_millis(2));
        let req = request();
        assert!(c.check(&req).is_none());
        // Kept 10 s: a stalled test runner cannot see it lapse between two lines.
        let o = refusal(10_000_000);
        c.insert(&req, &o, Instant::now());
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
        c.insert(&req, &o, Instant::now());
        assert!(c.check(&req).is_some());
        // Kept 50 ms: gone once they have passed.
        c.insert(&req, &refusal(50_000), Instant::now());
        std::thread::sleep(Duration::from_millis(60));
        assert!(c.check(&req).is_none(), "expired");
    }

    #[test]
    fn a_give_back_heard_ends_a_refusal_and_any_decided_before_it() {
        let c = DenyCache::new();
        let req = request();
        let tag = keys::key_tag(&req.key);
        // Not subscribed: nothing is kept.
        c.insert(&req, &refusal(10_000_000), Instant::now());
        assert!(c.check(&req).is_none());
        let before_link = Instant::now();
        c.linked(true);
        c.insert(&req, &refusal(10_000_000), before_link);
        assert!(
            c.check(&req).is_none(),
            "decided before the subscription stood"
        );
        std::thread::sleep(Duration::from_millis(2));
        c.insert(&req, &refusal(10_000_000), Instant::now());
        assert!(c.check(&req).is_some());
        // Another key's give-back changes nothing; this key's ends the refusal.
        c.heard(&keys::key_tag(&[2; 32]));
        assert!(c.check(&req).is_some());
        let sent = Instant::now();
        c.heard(&tag);
        assert!(c.check(&req).is_none());
        // A refusal sent before the give-back was heard, whose reply comes after it.
        c.insert(&req, &refusal(10_000_000), sent);
        assert!(c.check(&req).is_none(), "decided before the give-back");
        c.insert(&req, &refusal(10_000_000), Instant::now());
        assert!(c.check(&req).is_some());
        // The subscription lost: everything kept is dropped.
        c.linked(false);
        assert!(c.check(&req).is_none());
        c.insert(&req, &refusal(10_000_000), Instant::now());
        assert!(c.check(&req).is_none());
    }

    #[test]
    fn a_kept_refusal_counts_the_units_drained_since() {
        let c = DenyCache::new();
        c.linked(true);
        std::thread::sleep(Duration::from_millis(2));
        // 120 a minute: 2 units a second. Redis: 0 left, full again in 60 s.
        let req = request();
        let o = Outcome {
            remaining: 0,
            ..refusal(60_000_000)
        };
        c.insert(&req, &o, Instant::now());
        assert_eq!(c.check(&req).unwrap().remaining, 0);
        std::thread::sleep(Duration::from_millis(1_100));
        let later = c.check(&req).unwrap();
        // 1.1 s or more later: at least 2 units back.
        assert!(later.remaining >= 2, "{}", later.remaining);
        assert!(later.reset_us <= 58_900_000);
    }
}
