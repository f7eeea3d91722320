//! What the fallback admitted, still to be charged to the shared budget.
//!
//! While the shared store is unreachable each instance admits on its local share; those units
//! are owed to the shared budget and charged there, in full, when it returns (DESIGN §4). The
//! ledger aggregates per key (one entry however many requests), and holds at most
//! [`MAX_KEYS`] keys: past that, new keys' charges are not remembered (an outage touching more
//! keys than that would need more memory than it is worth; those keys get one extra burst).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use super::{lock, short_key, AdmitRequest, Bucket, Extra};
use crate::budget::Limit;
use crate::identity::KeyHash;

pub(crate) const MAX_KEYS: usize = 100_000;

/// Units one key owes the shared budget.
#[derive(Debug, Clone)]
pub(crate) struct Owed {
    pub key: KeyHash,
    /// The shared limit (the key's plan), not the local share.
    pub limit: Limit,
    /// The plan's further budgets, owed the same units.
    pub also: Vec<Extra>,
    pub units: u64,
    /// The id of the write-back that carried them (0: not sent yet): one that may have run
    /// is sent again with its id and its units, and Redis charges an id once.
    pub id: u64,
}

/// The ledger entry of a key's charges: one per key, and one per key and route for the
/// requests that also drew on a route's `shared` budget (whose debt is that route's).
fn entry_of(key: &KeyHash, also: &[Extra]) -> u128 {
    let mut k = short_key(key);
    for e in also {
        if let Bucket::Route(label) = &e.bucket {
            k ^= short_key(&crate::identity::hash_key(label.as_bytes())).rotate_left(1);
        }
    }
    k
}

#[derive(Debug, Default)]
struct Inner {
    owed: HashMap<u128, Owed>,
    /// Entries the sending task took and has not finished sending: their keys' next
    /// decisions wait for it, or they would overtake the debt (another connection).
    sending: HashSet<u128>,
    /// Write-backs sent that may have run: sent again as they are (same id, same units).
    doubtful: Vec<Owed>,
    /// Entries a request took to send itself ([`Ledger::in_hand`]), and how many requests
    /// of each are sending.
    in_hand: HashMap<u128, usize>,
    /// A task is sending the ledger to the store.
    flushing: bool,
}

impl Inner {
    /// Entries owed, being sent (by the task or a request), or sent in doubt: while there is
    /// any, the sending task goes on (one a request puts back is then sent too).
    fn len(&self) -> usize {
        self.owed.len() + self.sending.len() + self.doubtful.len() + self.in_hand.len()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Ledger {
    inner: Mutex<Inner>,
    /// Keys owing or being sent: lets the request path skip the lock when nothing is owed.
    len: AtomicUsize,
    full_warned: AtomicBool,
    /// Told when a send of the task is over.
    sent: Notify,
}

/// A request's send of what it took of a key's entry in the ledger, under way.
pub(crate) struct InHand<'a>(&'a Ledger, u128);

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        let mut inner = lock(&self.0.inner);
        if let Some(n) = inner.in_hand.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                inner.in_hand.remove(&self.1);
            }
        }
        self.0.len.store(inner.len(), Ordering::Relaxed);
    }
}

impl Ledger {
    /// Adds `units` to what `req.key` owes, to each of its budgets. True when no task is
    /// sending the ledger yet: the caller should start one (and the ledger now counts it as
    /// started).
    pub fn add(&self, req: &AdmitRequest, units: u64) -> bool {
        let key = &req.key;
        let mut inner = lock(&self.inner);
        let k = entry_of(key, &req.also);
        let len = inner.owed.len();
        match inner.owed.get_mut(&k) {
            Some(o) => {
                o.units = o.units.saturating_add(units);
                o.limit = req.limit;
                if o.also != req.also {
                    o.also = req.also.clone();
                }
            }
            None if len >= MAX_KEYS => {
                if !self.full_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        keys = MAX_KEYS,
                        "write-back ledger full: further keys' fallback charges are not written back"
                    );
                }
            }
            None => {
                inner.owed.insert(
                    k,
                    Owed {
                        key: *key,
                        limit: req.limit,
                        also: req.also.clone(),
                        units,
                        id: 0,
                    },
                );
            }
        }
        self.len.store(inner.len(), Ordering::Relaxed);
        !std::mem::replace(&mut inner.flushing, true)
    }

    /// A debit under id `o.id` that may have run: sent again as it is (Redis charges an id
    /// once). True when no task is sending the ledger yet: the caller should start one.
    pub fn add_doubtful(&self, o: Owed) -> bool {
        let mut inner = lock(&self.inner);
        if inner.len() < MAX_KEYS {
            inner.doubtful.push(o);
        }
        self.len.store(inner.len(), Ordering::Relaxed);
        !std::mem::replace(&mut inner.flushing, true)
    }

    /// True while `req.key` owes units, or the sending task or a request is sending them.
    pub fn owes(&self, req: &AdmitRequest) -> bool {
        if self.len.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let k = entry_of(&req.key, &req.also);
        let inner = lock(&self.inner);
        inner.owed.contains_key(&k)
            || inner.sending.contains(&k)
            || inner.in_hand.contains_key(&k)
            || inner
                .doubtful
                .iter()
                .any(|o| entry_of(&o.key, &o.also) == k)
    }

    /// Waits (at most `within`) until the sending task is no longer sending `req.key`'s
    /// units: sent, or put back to be taken.
    pub async fn sending_done(&self, req: &AdmitRequest, within: Duration) {
        let k = entry_of(&req.key, &req.also);
        let _ = tokio::time::timeout(within, async {
            loop {
                let sent = self.sent.notified();
                tokio::pin!(sent);
                sent.as_mut().enable();
                if !lock(&self.inner).sending.contains(&k) {
                    return;
                }
                sent.await;
            }
        })
        .await;
    }

    /// The sending task is done with `o`: sent (or possibly sent).
    pub fn done_sending(&self, o: &Owed) {
        let mut inner = lock(&self.inner);
        inner.sending.remove(&entry_of(&o.key, &o.also));
        self.len.store(inner.len(), Ordering::Relaxed);
        drop(inner);
        self.sent.notify_waiters();
    }

    /// What `req.key` owes: write-backs that may have run first (as they were), then the rest.
    /// (A request sends them itself: it holds [`Ledger::in_hand`] meanwhile.)
    pub fn take(&self, req: &AdmitRequest) -> Vec<Owed> {
        let k = entry_of(&req.key, &req.also);
        let mut inner = lock(&self.inner);
        let (mut out, rest): (Vec<Owed>, Vec<Owed>) = std::mem::take(&mut inner.doubtful)
            .into_iter()
            .partition(|o| entry_of(&o.key, &o.also) == k);
        inner.doubtful = rest;
        out.extend(inner.owed.remove(&k));
        self.len.store(inner.len(), Ordering::Relaxed);
        out
    }

    /// Held by a request while it sends what it took of `req.key`'s debt ([`Ledger::take`]):
    /// the key still owes meanwhile (`owes`: a refund waits for it), and an exit waits for it
    /// (`is_empty`). Its drop says it is over, however the send ended (a request whose client
    /// left drops it mid-send).
    pub fn in_hand(&self, req: &AdmitRequest) -> InHand<'_> {
        let k = entry_of(&req.key, &req.also);
        let mut inner = lock(&self.inner);
        *inner.in_hand.entry(k).or_default() += 1;
        self.len.store(inner.len(), Ordering::Relaxed);
        InHand(self, k)
    }

    /// Everything owed, for the sending task, which tells [`Ledger::done_sending`] of each.
    pub fn take_all(&self) -> Vec<Owed> {
        let mut inner = lock(&self.inner);
        let mut all: Vec<Owed> = std::mem::take(&mut inner.doubtful);
        all.extend(inner.owed.drain().map(|(_, o)| o));
        let keys: Vec<u128> = all.iter().map(|o| entry_of(&o.key, &o.also)).collect();
        inner.sending.extend(keys);
        self.len.store(inner.len(), Ordering::Relaxed);
        all
    }

    /// What could not be sent goes back (merged with what was owed meanwhile).
    /// (The sending task is done with them: they are to be taken again.)
    pub fn put_back(&self, owed: impl IntoIterator<Item = Owed>) {
        let mut inner = lock(&self.inner);
        for o in owed {
            let k = entry_of(&o.key, &o.also);
            inner.sending.remove(&k);
            if o.id != 0 {
                inner.doubtful.push(o);
                continue;
            }
            inner
                .owed
                .entry(k)
                .and_modify(|e| e.units = e.units.saturating_add(o.units))
                .or_insert(o);
        }
        self.len.store(inner.len(), Ordering::Relaxed);
        drop(inner);
        self.sent.notify_waiters();
    }

    /// A refunded fallback charge: forgets up to `units` of the key's debt. False when the
    /// debt was no longer here (already sent to the store).
    pub fn forgive(&self, req: &AdmitRequest) -> bool {
        let units = req.cost;
        let mut inner = lock(&self.inner);
        let k = entry_of(&req.key, &req.also);
        let Some(o) = inner.owed.get_mut(&k) else {
            return false;
        };
        o.units = o.units.saturating_sub(units);
        if o.units == 0 {
            inner.owed.remove(&k);
        }
        self.len.store(inner.len(), Ordering::Relaxed);
        true
    }

    /// Nothing is owed, nor being sent (by the task, or by a request).
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// What is still owed, for the exit's last word: the keys (entries, those being sent
    /// included) and the units of those not being sent.
    pub fn outstanding(&self) -> (usize, u64) {
        let inner = lock(&self.inner);
        let units = inner.owed.values().chain(&inner.doubtful).map(|o| o.units);
        (inner.len(), units.sum())
    }

    /// The sending task is done if nothing is owed; true when it should stop.
    pub fn done_if_empty(&self) -> bool {
        let mut inner = lock(&self.inner);
        if inner.len() == 0 {
            inner.flushing = false;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn aggregates_per_key_and_forgives_refunds() {
        let l = Ledger::default();
        let lim = Limit::new(10, Duration::from_secs(60), Duration::ZERO).unwrap();
        let req = |key: u8, cost: u64| AdmitRequest {
            key: [key; 32],
            limit: lim,
            also: vec![],
            cost,
            key_cap: None,
            route: std::sync::Arc::from("r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        assert!(l.add(&req(1, 2), 2), "first: start a sender");
        assert!(!l.add(&req(1, 3), 3));
        assert!(!l.add(&req(2, 1), 1));
        assert!(l.owes(&req(1, 0)) && !l.owes(&req(3, 0)));
        assert!(l.forgive(&req(2, 1)));
        assert!(!l.owes(&req(2, 0)));
        assert!(!l.forgive(&req(2, 1)), "nothing left to forgive");
        let all = l.take_all();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].units, 5);
        l.put_back(all);
        let in_hand = l.in_hand(&req(1, 0));
        assert_eq!(l.take(&req(1, 0)).first().map(|o| o.units), Some(5));
        // A request sends it: the key owes until it is done (a refund waits), and an exit
        // waits for it, however that send ends.
        assert!(!l.is_empty() && l.owes(&req(1, 0)) && !l.owes(&req(2, 0)));
        drop(in_hand);
        assert!(l.is_empty() && !l.owes(&req(1, 0)));
        assert!(l.done_if_empty());
        assert!(l.add(&req(1, 1), 1), "sender stopped: start another");
    }
}
