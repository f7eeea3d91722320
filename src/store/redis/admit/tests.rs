use super::*;
use crate::budget::Limit;
use std::time::Duration;

fn call(cost: u64) -> AdmitCall {
    AdmitCall {
        budget: "t{a}b".into(),
        key_slots: None,
        route_slots: Some("t:r{b}f".into()),
        // 120 units per 60 s: one unit is 0.5 s of drain.
        limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
        cost,
        key_cap: 0,
        route_cap: 5,
        lease_id: "i:1".into(),
        record: "t{a}ai:1".into(),
        lease_ttl_us: 15_000_000,
        also: Vec::new(),
        holds: "t{a}h".into(),
        slice: 0,
        grant: 0,
        hold_ttl_us: 0,
        settle: 0,
        unspent: 0,
        if_lost: Default::default(),
    }
}

/// A full route answers with the key's figures as they were before the undone charge.
#[test]
fn route_busy_reply_shows_the_budget_before_the_undone_charge() {
    // One unit is 500 000 ticks here (drained at 1 per µs).
    let admitted = [
        AdmitCode::Admitted as i64,
        0,
        100,
        10_000_000,
        0,
        7,
        10_000_000,
        3,
    ];
    assert_eq!(
        route_busy_reply(&admitted, &call(20)),
        vec![AdmitCode::RouteBusy as i64, 0, 120, 0, 0, 7, 0, 3]
    );
    let delayed = [
        AdmitCode::Admitted as i64,
        2_000_000,
        0,
        62_000_000,
        0,
        7,
        62_000_000,
        0,
    ];
    assert_eq!(
        route_busy_reply(&delayed, &call(4)),
        vec![
            AdmitCode::RouteBusy as i64,
            0,
            0,
            60_000_000,
            0,
            7,
            60_000_000,
            0
        ]
    );
}

#[test]
fn refunds_are_sent_again_unless_they_timed_out() {
    assert!(!refund_again(&StoreError::Timeout));
    assert!(refund_again(&StoreError::BreakerOpen));
    assert!(refund_again(&StoreError::ConnectTimeout));
    let dropped =
        redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    assert!(refund_again(&StoreError::from(dropped)));
    let script_error = redis::RedisError::from((
        redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
        "x",
    ));
    // An error reply: the refund did not run, so it is sent again.
    assert!(refund_again(&StoreError::from(script_error)));
}
