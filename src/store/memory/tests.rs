use super::*;

fn req(cost: u64, key_cap: Option<u32>, route_cap: Option<u32>, queue_ms: u64) -> AdmitRequest {
    AdmitRequest {
        key: [7; 32],
        limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
        also: vec![],
        cost,
        key_cap,
        route: Arc::from("/reports/generate"),
        route_cap,
        queue_timeout: Duration::from_millis(queue_ms),
        fair: Default::default(),
    }
}

#[tokio::test]
async fn charges_and_refuses_without_writing() {
    let s = MemoryStore::new(Clock::new(0));
    let r = req(20, None, None, 0);
    let mut leases = vec![];
    for want in [100, 80, 60, 40, 20, 0] {
        match s.admit(&r).await {
            Admission::Admitted {
                standing, lease, ..
            } => {
                assert_eq!(standing.remaining, want);
                leases.push(lease);
            }
            other => panic!("{other:?}"),
        }
    }
    for _ in 0..10 {
        match s.admit(&r).await {
            Admission::OverBudget { retry_after_us, .. } => assert!(retry_after_us > 0),
            other => panic!("{other:?}"),
        }
    }
    s.refund(&r);
    assert!(matches!(s.admit(&r).await, Admission::Admitted { .. }));
}

#[tokio::test]
async fn key_cap_and_release_on_drop() {
    let s = MemoryStore::new(Clock::new(0));
    let r = req(1, Some(2), None, 0);
    let a = s.admit(&r).await;
    let b = s.admit(&r).await;
    assert!(matches!(s.admit(&r).await, Admission::KeyBusy(_)));
    drop(a);
    assert!(matches!(s.admit(&r).await, Admission::Admitted { .. }));
    drop(b);
}

#[tokio::test]
async fn route_cap_queues_fifo_then_503() {
    let s = MemoryStore::new(Clock::new(0));
    let r = req(1, None, Some(1), 200);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!()
    };
    assert_eq!(s.route_in_flight("/reports/generate"), 1);
    // A waiter gets the slot as soon as it is released.
    let s2 = s.clone();
    let r2 = r.clone();
    let waiter = tokio::spawn(async move { s2.admit(&r2).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    lease.release().await;
    let Admission::Admitted { queued, lease, .. } = waiter.await.unwrap() else {
        panic!()
    };
    assert!(queued >= Duration::from_millis(40), "{queued:?}");
    // Nobody releases now: after 200 ms, route-busy, and nothing charged.
    let before = s.peek(&r.key, &r.limit, &[])[0];
    assert!(matches!(s.admit(&r).await, Admission::RouteBusy { .. }));
    assert_eq!(s.peek(&r.key, &r.limit, &[])[0].remaining, before.remaining);
    drop(lease);
    assert_eq!(s.route_in_flight("/reports/generate"), 0);
}

#[tokio::test]
async fn idle_keys_are_evicted() {
    let s = MemoryStore::new(Clock::new(0));
    let mut r = req(1, None, None, 0);
    r.limit = Limit::new(1000, Duration::from_millis(1), Duration::ZERO).unwrap();
    for i in 0..100u8 {
        r.key = [i; 32];
        drop(s.admit(&r).await);
    }
    assert_eq!(s.len(), 100);
    for sh in s.shards.iter() {
        lock(sh).last_sweep_us = 0;
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    for sh in s.shards.iter() {
        lock(sh).sweep(s.now_us() + SWEEP_EVERY_US);
    }
    assert_eq!(s.len(), 0);
}

/// A reload that lengthens a budget's drain: what the key spent is kept past the old
/// budget's time until empty, through the sweep (which judges a state by the rate it was
/// stored with). It was swept an hour after the spending and the key had all 10 back.
#[tokio::test]
async fn units_carried_by_a_reload_outlive_the_old_budgets_emptying() {
    let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(1_000_000)));
    let s = MemoryStore::new(Clock::manual(now));
    let hour = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let day = Limit::new(10, Duration::from_secs(86_400), Duration::ZERO).unwrap();
    let mut r = req(10, None, None, 0);
    r.limit = hour;
    assert!(matches!(s.admit(&r).await, Admission::Admitted { .. }));
    r.limit = day;
    r.cost = 1;
    assert!(matches!(s.admit(&r).await, Admission::OverBudget { .. }));
    // An hour and a minute on (the old budget is empty again), a sweep of the key's shard.
    now.fetch_add(3_660_000_000, Ordering::Relaxed);
    s.shard(short_key(&r.key))
        .sweep(now.load(Ordering::Relaxed));
    let Admission::OverBudget { retry_after_us, .. } = s.admit(&r).await else {
        panic!("the carried units were dropped")
    };
    // One unit of 10 a day is 2.4 h; 61 minutes of it have drained.
    assert_eq!(retry_after_us, 8_640_000_000 - 3_660_000_000);
}
