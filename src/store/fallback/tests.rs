//! The `on_error` policy against a shared store that fails on demand (no Redis needed).

use super::*;
use crate::store::memory::Clock;
use crate::store::{Lease, Standing};
use std::sync::atomic::AtomicU32;
use std::time::Instant;

/// A shared store that fails while `down` is set, and otherwise admits everything.
#[derive(Default)]
struct Fake {
    down: AtomicBool,
    calls: AtomicU32,
    /// Units refunded.
    refunded: AtomicU32,
    /// Units written back.
    written: AtomicU32,
    /// Further budgets the write-backs named.
    written_also: AtomicU32,
    /// How long a failing `admit` takes to fail (ms): a call that waited in the shared queue.
    fail_after_ms: AtomicU32,
}

impl SharedStore for Fake {
    async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Result<SharedAnswer, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.down.load(Ordering::Relaxed) {
            let after = self.fail_after_ms.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(after.into())).await;
            return Err(StoreError::Timeout);
        }
        Ok(SharedAnswer {
            admission: Admission::Admitted {
                standing: Standing {
                    remaining: req.limit.max_cost(),
                    reset_us: 0,
                    each: Default::default(),
                },
                delay_us: 0,
                lease: Lease::shared(None),
                queued: Duration::ZERO,
            },
            reached: true,
        })
    }

    async fn refund(&self, req: &AdmitRequest, hold: u128) -> Result<Refunded, StoreError> {
        if hold != 0 {
            // Back into this instance's slice, as the Redis store does while the slice lives.
            return Ok(Refunded::Slice);
        }
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::BreakerOpen);
        }
        self.refunded.fetch_add(req.cost as u32, Ordering::Relaxed);
        Ok(Refunded::Store(None))
    }

    async fn peek(
        &self,
        _key: &KeyHash,
        limit: &Limit,
        _also: &[Extra],
    ) -> Result<Vec<BudgetView>, StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::BreakerOpen);
        }
        Ok(vec![BudgetView::at(limit, 0)])
    }

    async fn write_back(
        &self,
        _key: &KeyHash,
        _limit: &Limit,
        also: &[Extra],
        units: u64,
        _id: u64,
        _tell: bool,
    ) -> Result<(), StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::BreakerOpen);
        }
        self.written.fetch_add(units as u32, Ordering::Relaxed);
        self.written_also
            .fetch_add(also.len() as u32, Ordering::Relaxed);
        Ok(())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn release_all(self: &Arc<Self>) {}
}

fn store(on_error: OnError, fleet_size: u32) -> (Arc<Fake>, Arc<FallbackStore<Fake>>) {
    let fake = Arc::new(Fake::default());
    fake.down.store(true, Ordering::Relaxed);
    let s = FallbackStore::over(
        fake.clone(),
        MemoryStore::new(Clock::new(0)),
        on_error,
        fleet_size,
    );
    (fake, s)
}

fn req(cost: u64, route_cap: Option<u32>) -> AdmitRequest {
    AdmitRequest {
        key: [3; 32],
        limit: Limit::new(120, Duration::from_secs(3600), Duration::ZERO).unwrap(),
        also: vec![],
        cost,
        key_cap: None,
        route: Arc::from("/r"),
        route_cap,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

/// A plan's second budget: 10 units a day.
fn day_budget() -> Extra {
    Extra {
        bucket: super::super::Bucket::Key("day".into()),
        limit: Limit::new(10, Duration::from_secs(86_400), Duration::ZERO).unwrap(),
    }
}

/// Each budget's units left, in order.
fn remaining_each(s: &Standing) -> Vec<u64> {
    s.each.as_slice().iter().map(|f| f.remaining).collect()
}

fn admitted(a: &Admission) -> bool {
    matches!(a, Admission::Admitted { .. })
}

#[tokio::test]
async fn deny_refuses_and_is_not_ready() {
    let (fake, s) = store(OnError::Deny, 1);
    assert!(s.ready() && !s.degraded());
    assert!(matches!(
        s.admit(&req(1, None)).await,
        Admission::Unavailable
    ));
    assert!(s.degraded() && !s.ready());
    // A refund that went back into this instance's slice says nothing of the store.
    s.refund(&req(1, None), Charge::Slice(1)).await;
    assert!(s.degraded() && !s.ready(), "still down");
    fake.down.store(false, Ordering::Relaxed);
    assert!(admitted(&s.admit(&req(1, None)).await));
    assert!(!s.degraded() && s.ready(), "back on the shared store");
}

#[tokio::test]
async fn local_enforces_the_share_of_budget_and_cap() {
    let (_fake, s) = store(OnError::Local, 3);
    // 120/3 = 40 units: two requests of 20.
    let r = req(20, None);
    let mut held = vec![];
    for _ in 0..2 {
        let a = s.admit(&r).await;
        assert!(admitted(&a), "{a:?}");
        held.push(a);
    }
    assert!(matches!(s.admit(&r).await, Admission::OverBudget { .. }));
    assert!(s.degraded() && s.ready());
    // A cap of 6 over 3 instances: 2 here.
    let capped = AdmitRequest {
        key: [4; 32],
        ..req(1, Some(6))
    };
    let a = s.admit(&capped).await;
    let b = s.admit(&capped).await;
    assert!(admitted(&a) && admitted(&b));
    assert!(matches!(
        s.admit(&capped).await,
        Admission::RouteBusy { .. }
    ));
    let Admission::Admitted { lease, .. } = a else {
        unreachable!()
    };
    assert_eq!(lease.charge(), Charge::Local(capped.limit.fraction(3)));
}

/// A request that costs more than this instance's share of a budget can ever hold is refused
/// during an outage with a `Retry-After` of 1 s: it passes as soon as the shared store answers
/// again. It said two windows (7,200 s for this hour's budget), the share's time to hold it.
/// One the share could hold later keeps its true wait.
#[tokio::test]
async fn beyond_the_local_share_retries_when_the_store_may_be_back() {
    let (_fake, s) = store(OnError::Local, 3);
    // 120/3 = 40 units here.
    match s.admit(&req(50, None)).await {
        Admission::OverBudget { retry_after_us, .. } => assert_eq!(retry_after_us, 1_000_000),
        other => panic!("{other:?}"),
    }
    assert!(admitted(&s.admit(&req(40, None)).await));
    match s.admit(&req(10, None)).await {
        // 10 of the share's 40 units an hour: 15 minutes.
        Admission::OverBudget { retry_after_us, .. } => {
            assert_eq!(crate::budget::retry_after_secs(retry_after_us), 900)
        }
        other => panic!("{other:?}"),
    }
    // A plan's second budget beyond its share (10 a day: 3 here) counts too.
    let r = AdmitRequest {
        key: [5; 32],
        also: vec![day_budget()],
        ..req(5, None)
    };
    match s.admit(&r).await {
        Admission::OverBudget { retry_after_us, .. } => assert_eq!(retry_after_us, 1_000_000),
        other => panic!("{other:?}"),
    }
}

/// `allow` admits past the count and goes on counting: the headers say what was spent (the
/// key is in debt here, as it will be in the shared store once it is written back), and a
/// refund comes off the count. Past the count they said what they said at its end.
#[tokio::test]
async fn allow_admits_past_the_count_and_counts_it() {
    let (_fake, s) = store(OnError::Allow, 1);
    let r = req(60, Some(1));
    let mut seen = vec![];
    for _ in 0..4 {
        let Admission::Admitted {
            lease, standing, ..
        } = s.admit(&r).await
        else {
            panic!("allow admits")
        };
        // Whole minutes until full again: 60 units of 120 an hour are 30 minutes.
        seen.push((
            lease.charge(),
            standing.remaining,
            standing.reset_us.div_ceil(60_000_000),
        ));
    }
    let local = Charge::Local(r.limit);
    assert_eq!(
        seen,
        [
            (local, 60, 30),
            (local, 0, 60),
            (local, 0, 90),
            (local, 0, 120)
        ]
    );
    s.refund(&r, local).await;
    let Admission::Admitted { standing, .. } = s.admit(&r).await else {
        panic!("allow admits")
    };
    assert_eq!(standing.reset_us.div_ceil(60_000_000), 120);
}

#[tokio::test]
async fn a_refund_goes_back_where_it_was_charged() {
    let (fake, s) = store(OnError::Local, 1);
    let r = req(120, None);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!()
    };
    assert!(matches!(s.admit(&r).await, Admission::OverBudget { .. }));
    s.refund(&r, lease.charge()).await;
    assert!(admitted(&s.admit(&r).await), "the local share got it back");
    let peek = s.peek(&r.key, &r.limit, &[]).await.unwrap();
    assert_eq!(
        peek.local_share,
        Some(1),
        "no shared view: the local share's"
    );
    fake.down.store(false, Ordering::Relaxed);
    let peek = s.peek(&r.key, &r.limit, &[]).await.unwrap();
    assert_eq!(peek.local_share, None, "the shared view");
    assert!(!s.degraded());
}

#[tokio::test]
async fn the_local_share_counts_requests_the_shared_store_admitted() {
    let (fake, s) = store(OnError::Local, 2);
    fake.down.store(false, Ordering::Relaxed);
    // Cap 4 over 2 instances: a share of 2. Three run here through the shared store.
    let r = req(1, Some(4));
    let mut held = vec![];
    for _ in 0..3 {
        let d = s.decide(&r).await;
        assert!(admitted(&d.admission) && !d.fallback);
        held.push(d.admission);
    }
    fake.down.store(true, Ordering::Relaxed);
    let d = s.decide(&r).await;
    assert!(d.fallback);
    assert!(
        matches!(d.admission, Admission::RouteBusy { .. }),
        "3 ≥ 2 here already"
    );
    held.truncate(1);
    let d = s.decide(&r).await;
    let Admission::Admitted { lease, .. } = d.admission else {
        panic!("one shared and this one: the share of 2")
    };
    assert!(lease.fallback());
    assert!(matches!(s.admit(&r).await, Admission::RouteBusy { .. }));
    lease.release().await;
    assert!(admitted(&s.admit(&r).await), "freed by the release");
}

/// A request that spent part of its `queue_timeout` on the shared store (queued there, then
/// the store failed) waits on the local share only for the rest: the wait for a slot is
/// bounded by `queue_timeout` from the request's start, not given again by the fallback. On a
/// paused clock (it moves only to the next timer), so the figure is exact.
#[tokio::test(start_paused = true)]
async fn the_fallback_waits_only_what_is_left_of_the_queue_timeout() {
    let (fake, s) = store(OnError::Local, 1);
    fake.down.store(false, Ordering::Relaxed);
    let mut r = req(1, Some(1));
    r.queue_timeout = Duration::from_millis(4000);
    // The one slot of this instance's share, taken through the shared store.
    let held = s.decide(&r).await;
    assert!(admitted(&held.admission) && !held.fallback);
    fake.down.store(true, Ordering::Relaxed);
    fake.fail_after_ms.store(3000, Ordering::Relaxed);
    let start = tokio::time::Instant::now();
    let d = s.decide(&r).await;
    let took = start.elapsed();
    assert!(d.fallback);
    assert!(matches!(d.admission, Admission::RouteBusy { .. }));
    // 4 s in all (timers fire on the millisecond); a fresh queue_timeout on the local share
    // would make it 7 s.
    assert!(
        took >= Duration::from_millis(4000) && took <= Duration::from_millis(4001),
        "{took:?}"
    );
    drop(held);
}

/// DESIGN §4: a request waiting in the local queue when the shared store answers again leaves
/// it for the shared store's decision (whose queue is the fleet's) at once, not when a local
/// slot frees: a slot taken locally then would be one more than the fleet's cap. Its local
/// charge is given back and is not owed; the time it queued locally counts in `queued`.
#[tokio::test(start_paused = true)]
async fn a_local_waiter_is_decided_by_the_store_once_it_answers() {
    let (fake, s) = store(OnError::Local, 1);
    let mut r = req(1, Some(1));
    r.queue_timeout = Duration::from_secs(10);
    let held = s.decide(&r).await;
    assert!(admitted(&held.admission) && held.fallback);
    let waiter = tokio::spawn({
        let (s, r) = (s.clone(), r.clone());
        async move { s.decide(&r).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiter.is_finished(), "queued behind the local slot");
    let calls = fake.calls.load(Ordering::Relaxed);
    fake.down.store(false, Ordering::Relaxed);
    // Something sees the store answer (the probe, in the binary).
    assert!(s
        .peek(&r.key, &r.limit, &[])
        .await
        .unwrap()
        .local_share
        .is_none());
    let d = tokio::time::timeout(Duration::from_millis(1), waiter)
        .await
        .expect("woken by the store's return, not by a freed slot")
        .unwrap();
    assert!(!d.fallback, "decided by the shared store");
    let Admission::Admitted { queued, .. } = d.admission else {
        panic!("{:?}", d.admission)
    };
    assert_eq!(queued, Duration::from_secs(1));
    assert_eq!(fake.calls.load(Ordering::Relaxed), calls + 1);
    assert_eq!(
        fake.written.load(Ordering::Relaxed),
        1,
        "only the held request's local unit is owed"
    );
    let left = s.local.peek(&r.key, &r.limit, &[]);
    assert_eq!(left[0].remaining, 119, "the waiter's local unit given back");
    drop(held);
}

#[tokio::test]
async fn fallback_charges_are_written_back_before_the_next_shared_decision() {
    let (fake, s) = store(OnError::Local, 2);
    let r = req(20, None);
    let mut leases = vec![];
    for _ in 0..3 {
        let Admission::Admitted { lease, .. } = s.admit(&r).await else {
            panic!()
        };
        leases.push(lease);
    }
    // One refunded (the upstream never answered): not owed any more.
    let refunded = leases.pop().unwrap();
    s.refund(&r, refunded.charge()).await;
    assert_eq!(fake.written.load(Ordering::Relaxed), 0);
    fake.down.store(false, Ordering::Relaxed);
    let d = s.decide(&r).await;
    assert!(!d.fallback && admitted(&d.admission));
    assert_eq!(fake.written.load(Ordering::Relaxed), 40, "in full, once");
    tokio::time::sleep(WRITE_BACK_EVERY * 3).await;
    assert_eq!(fake.written.load(Ordering::Relaxed), 40);
}

#[tokio::test]
async fn what_is_owed_is_written_back_without_traffic() {
    let (fake, s) = store(OnError::Allow, 1);
    for _ in 0..3 {
        assert!(admitted(&s.admit(&req(50, None)).await));
    }
    tokio::time::sleep(WRITE_BACK_EVERY * 2).await;
    assert_eq!(fake.written.load(Ordering::Relaxed), 0, "still down");
    fake.down.store(false, Ordering::Relaxed);
    let start = Instant::now();
    while fake.written.load(Ordering::Relaxed) < 150 {
        assert!(start.elapsed() < Duration::from_secs(2));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        fake.written.load(Ordering::Relaxed),
        150,
        "past the budget: a debt"
    );
}

/// `cost_per_second`'s extra goes where the admission was charged: the shared budget by a
/// debit when Redis admitted; the local share, and then the shared budget by write-back, when
/// the fallback did; and a shared debit that surely never ran is owed, not lost.
#[tokio::test]
async fn time_charges_follow_the_admission() {
    let (fake, s) = store(OnError::Local, 1);
    let r = req(1, None);
    fake.down.store(false, Ordering::Relaxed);
    s.charge_extra(&r, Charge::Shared, 5).await;
    assert_eq!(fake.written.load(Ordering::Relaxed), 5);

    fake.down.store(true, Ordering::Relaxed);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!("the fallback admits")
    };
    let local = lease.charge();
    assert!(matches!(local, Charge::Local(_)));
    s.charge_extra(&r, local, 4).await;
    // 120 locally: 1 admitted + 4 billed.
    assert_eq!(s.local.peek(&r.key, &r.limit, &[])[0].remaining, 115);
    s.charge_extra(&r, Charge::Shared, 2).await;
    // Back: the next decision for the key first sends the 1 + 4 + 2 owed.
    fake.down.store(false, Ordering::Relaxed);
    assert!(admitted(&s.admit(&r).await));
    assert_eq!(fake.written.load(Ordering::Relaxed), 5 + 7);
}

#[tokio::test]
async fn local_share_and_write_back_cover_every_budget() {
    let (fake, s) = store(OnError::Local, 2);
    // The first budget's share is 60, the day budget's 10/2 = 5: the day one refuses.
    let r = AdmitRequest {
        also: vec![day_budget()],
        ..req(2, None)
    };
    let a = s.admit(&r).await;
    let b = s.admit(&r).await;
    assert!(admitted(&a) && admitted(&b));
    let Admission::OverBudget { standing: o, .. } = s.admit(&r).await else {
        panic!("the day budget's local share is spent")
    };
    assert_eq!(o.each.decisive, 1);
    // A refund of a local charge gives the units back to every budget's share.
    let Admission::Admitted { lease, .. } = b else {
        unreachable!()
    };
    s.refund(&r, lease.charge()).await;
    assert!(admitted(&s.admit(&r).await), "the refund made room in both");
    // Back on the shared store: what the fallback admitted is charged to every budget.
    fake.down.store(false, Ordering::Relaxed);
    assert!(admitted(&s.admit(&r).await));
    assert_eq!(
        fake.written.load(Ordering::Relaxed),
        4,
        "2 + 2 (one refunded)"
    );
    assert_eq!(
        fake.written_also.load(Ordering::Relaxed),
        1,
        "with the day budget"
    );
}

/// A key at its in-flight cap under `on_error: local` is told about every budget's local
/// share, the tightest at the top, as on the shared store: not the first budget alone.
#[tokio::test]
async fn a_busy_key_in_fallback_sees_every_budget() {
    let (_fake, s) = store(OnError::Local, 2);
    let r = AdmitRequest {
        also: vec![day_budget()],
        key_cap: Some(2),
        ..req(2, None)
    };
    let a = s.admit(&r).await;
    assert!(admitted(&a), "{a:?}");
    let Admission::KeyBusy(standing) = s.admit(&r).await else {
        panic!("one in flight of a cap of 2 over 2 instances")
    };
    // Shares: 120/2 = 60 of the first budget, 58 left; 10/2 = 5 of the day one, 3 left.
    assert_eq!(remaining_each(&standing), [58, 3]);
    assert_eq!((standing.each.decisive, standing.remaining), (1, 3));
}

/// A route busy past its queue under `on_error: local`: the figures of the key's budget and of
/// the route's `shared` one, both local shares, the tightest at the top.
#[tokio::test]
async fn a_busy_route_in_fallback_sees_its_shared_budget_too() {
    let (_fake, s) = store(OnError::Local, 2);
    let r = AdmitRequest {
        also: vec![Extra {
            bucket: super::super::Bucket::Route("/r".into()),
            limit: Limit::new(20, Duration::from_secs(3600), Duration::ZERO).unwrap(),
        }],
        ..req(4, Some(2))
    };
    let a = s.admit(&r).await;
    assert!(admitted(&a), "{a:?}");
    let Admission::RouteBusy { standing, .. } = s.admit(&r).await else {
        panic!("one in flight of a route cap of 2 over 2 instances")
    };
    // Shares: 120/2 = 60 of the key's budget, 56 left; 20/2 = 10 of the route's, 6 left.
    assert_eq!(remaining_each(&standing), [56, 6]);
    assert_eq!((standing.each.decisive, standing.remaining), (1, 6));
}

/// A time charge in fallback lands on every budget's local share at the share's weight: with
/// fleet_size 2 the day budget of 10 is a share of 5, so after 1 admitted + 3 billed one more
/// request fits, and the next is refused by the day budget.
#[tokio::test]
async fn time_charges_weigh_every_local_share_alike() {
    let (fake, s) = store(OnError::Local, 2);
    fake.down.store(true, Ordering::Relaxed);
    let r = AdmitRequest {
        also: vec![day_budget()],
        ..req(1, None)
    };
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!("the fallback admits")
    };
    s.charge_extra(&r, lease.charge(), 3).await;
    assert!(
        admitted(&s.admit(&r).await),
        "1 of the day share's 5 is left"
    );
    let Admission::OverBudget { standing: o, .. } = s.admit(&r).await else {
        panic!("the day share is spent")
    };
    assert_eq!(o.each.decisive, 1, "refused by the day budget");
}

mod shared_charges;

/// A local charge refunded while its key's write-back is on its way (taken by the sending
/// task, or sent in doubt: it is sent again as it was) is given back after that write-back
/// lands, not once to a store that is away: the key ends charged nothing. (The refund went
/// once to the unreachable store and was lost: the write-back charged it all.)
#[tokio::test]
async fn a_refund_behind_its_write_back_goes_after_it() {
    let (fake, s) = store(OnError::Local, 1);
    let r = req(10, None);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!()
    };
    // The sending task has taken the debt and is sending it.
    let taken = s.owed.take_all();
    assert_eq!(taken.len(), 1);
    s.refund(&r, lease.charge()).await;
    assert_eq!(
        fake.refunded.load(Ordering::Relaxed),
        0,
        "the store is away"
    );
    // The send failed (it goes back to the ledger), and the store comes back.
    s.owed.put_back(taken);
    fake.down.store(false, Ordering::Relaxed);
    let start = Instant::now();
    while fake.refunded.load(Ordering::Relaxed) < 10 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the refund was lost"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fake.written.load(Ordering::Relaxed), 10);
}
