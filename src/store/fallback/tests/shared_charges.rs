//! What the shared store charged, seen from the fallback: its refunds sent again until they
//! reach it, and its admissions on budgets that hold (`max_delay`) mirrored in the local share.

use super::*;

/// A refund of a shared charge that could not reach the store (the breaker open: it surely did
/// not run) is sent again once the store is back (a 502/504 is refunded, DESIGN §3).
#[tokio::test]
async fn a_shared_refund_that_did_not_run_is_sent_again() {
    let (fake, s) = store(OnError::Local, 1);
    fake.down.store(false, Ordering::Relaxed);
    let r = req(7, None);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!("the shared store admits")
    };
    assert_eq!(lease.charge(), Charge::Shared);
    fake.down.store(true, Ordering::Relaxed);
    s.refund(&r, Charge::Shared).await;
    assert_eq!(fake.refunded.load(Ordering::Relaxed), 0);
    fake.down.store(false, Ordering::Relaxed);
    tokio::time::sleep(super::super::refunds::REFUND_RETRY_EVERY * 3).await;
    assert_eq!(fake.refunded.load(Ordering::Relaxed), 7);
}

/// A refund that cannot reach the store is sent again for as long as the charge would take to
/// drain (7 units of 120 an hour: 3.5 minutes), not for 30 s only: a minute's outage does not
/// keep the key charged.
#[tokio::test(start_paused = true)]
async fn a_shared_refund_is_sent_again_until_its_charge_would_have_drained() {
    let (fake, s) = store(OnError::Local, 1);
    fake.down.store(false, Ordering::Relaxed);
    let r = req(7, None);
    let Admission::Admitted { lease, .. } = s.admit(&r).await else {
        panic!("the shared store admits")
    };
    fake.down.store(true, Ordering::Relaxed);
    assert_eq!(lease.charge(), Charge::Shared);
    s.refund(&r, Charge::Shared).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(fake.refunded.load(Ordering::Relaxed), 0);
    fake.down.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(fake.refunded.load(Ordering::Relaxed), 7);
}

/// Under `on_error: local`, what the shared store admitted on a budget that can hold
/// (`max_delay`) is in the local share when an outage puts it in force (up to what the share
/// holds itself), so the share schedules after what the store scheduled here; a budget that
/// cannot hold is left alone (its share starts as it was).
#[tokio::test]
async fn the_local_share_of_a_holding_budget_counts_what_the_store_admitted() {
    let (fake, s) = store(OnError::Local, 2);
    let provider = Extra {
        bucket: crate::store::Bucket::Route("/r".into()),
        limit: Limit::new(10, Duration::from_secs(3600), Duration::from_secs(3600)).unwrap(),
    };
    let r = AdmitRequest {
        also: vec![provider],
        ..req(1, None)
    };
    fake.down.store(false, Ordering::Relaxed);
    for _ in 0..7 {
        assert!(admitted(&s.admit(&r).await));
    }
    // One of them refunded (its client left while held): the share has it back too.
    s.refund(&r, Charge::Shared).await;
    fake.down.store(true, Ordering::Relaxed);
    // The provider's share: 5 units and 5 more held (an hour at 5 an hour); 6 are taken.
    let mut local = vec![];
    for _ in 0..5 {
        local.push(s.admit(&r).await);
    }
    assert!(s.degraded());
    assert_eq!(local.iter().filter(|a| admitted(a)).count(), 4, "{local:?}");
    let Admission::OverBudget { standing, .. } = &local[4] else {
        panic!("{:?}", local[4])
    };
    // The key's own budget (no max_delay) was not charged by the store's admissions: 60 of
    // its share, less the 4 admitted here.
    assert_eq!(remaining_each(standing), [56, 0]);

    // More than the share holds is not carried: 30 more admitted by the store, on a key and
    // route of their own, leave it full, not 30 deep.
    let other = AdmitRequest {
        key: [9; 32],
        route: Arc::from("/other"),
        also: vec![Extra {
            bucket: crate::store::Bucket::Route("/other".into()),
            ..r.also[0].clone()
        }],
        ..r.clone()
    };
    fake.down.store(false, Ordering::Relaxed);
    for _ in 0..30 {
        assert!(admitted(&s.admit(&other).await));
    }
    fake.down.store(true, Ordering::Relaxed);
    let Admission::OverBudget { retry_after_us, .. } = s.admit(&other).await else {
        panic!("the share is full")
    };
    // One unit of 5 an hour drains in 12 minutes.
    assert!(
        (719_000_000..=720_000_000).contains(&retry_after_us),
        "{retry_after_us}"
    );
}
