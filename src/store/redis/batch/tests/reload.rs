//! Budgets against a reload (the units spent carried into the new budget, as the model
//! carries them) and the refund made once by its id: what `refund.lua` and `level_at` in
//! `common.lua` do when a budget changes under a key or a refund is sent again.

use super::*;

/// `c` sent as a new admission (its record gone) over a budget stored as `stored`.
async fn send_over(c: &AdmitCall, stored: &str, conn: &mut Conn) -> (AdmitCode, i64, i64) {
    let _: () = redis::cmd("SET")
        .arg(&c.budget)
        .arg(stored)
        .query_async(conn)
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&c.record)
        .query_async(conn)
        .await
        .unwrap();
    send(c, false, conn).await
}

/// A reload that changes a budget (its window, its `max_cost`) carries the units a key has
/// spent into the new budget, in Redis as in the model, through `admit_one` (one budget) and
/// `admit` (two): 10 of 10 an hour spent stay spent when the window becomes a day (keeping
/// the time until empty gave 9 more), and leave exactly 10 of 20 a day. A budget stored
/// before the ticks per unit were kept (three fields) keeps its time until empty.
#[tokio::test]
async fn a_reloaded_budget_carries_the_units_spent_as_the_model_does() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let model = MemoryStore::new(Clock::manual(now));
    let limit = |max_cost: u64, hours: u64| {
        Limit::new(max_cost, Duration::from_secs(3600 * hours), Duration::ZERO).unwrap()
    };
    let minute = Extra {
        bucket: Bucket::Key("minute".into()),
        limit: Limit::new(1000, Duration::from_secs(60), Duration::ZERO).unwrap(),
    };
    let mut n = 0;
    for (key, also) in [(60u8, vec![]), (61u8, vec![minute])] {
        // (limit, cost, admitted?) in order: spend all, the window grows, the budget doubles.
        let steps = [
            (limit(10, 1), 10, true),
            (limit(10, 24), 1, false),
            (limit(20, 24), 10, true),
            (limit(20, 24), 1, false),
        ];
        for (limit, cost, admits) in steps {
            let req = request(key, limit, also.clone(), cost);
            n += 1;
            let call = admit_call(
                &req,
                Ask::default(),
                format!("t:u{n}"),
                Duration::from_secs(60),
            );
            assert_eq!(call.is_common(), req.also.is_empty());
            let budget = call.budget.clone();
            let Packed(replies) = script::invoke(&AdmitBatch(&[call]).invocation(), &mut conn)
                .await
                .unwrap();
            now.store(replies[0][5] as u64, Ordering::Relaxed);
            let m = model.admit(&req).await;
            assert_eq!(
                redis_line(&replies[0]),
                model_line(&m),
                "key {key}, step {n}"
            );
            assert_eq!(
                matches!(m, Admission::Admitted { .. }),
                admits,
                "key {key}, step {n}: {m:?}"
            );
            if !admits && limit.max_cost() == 10 {
                // The refusal stored the carried units with the new budget's expiry (10
                // units of 10 a day: 24 h), not the old one's (1 h): Redis would have dropped
                // them then, and the key had its 10 back.
                let pttl: i64 = redis::cmd("PTTL")
                    .arg(&budget)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(pttl > 23 * 3_600_000, "PTTL {pttl} ms");
            }
        }
    }

    // Converted as crate::budget does, exactly, where the products pass 2^53: levels of 100
    // a week read as 100 in 30 days (ticks of 6,048,000,000 and 25,920,000,000 per unit).
    let week = limit(100, 24 * 7);
    let month = limit(100, 24 * 30);
    let req = request(63, month, vec![], 1);
    let call = admit_call(
        &req,
        Ask::default(),
        "t:exact".into(),
        Duration::from_secs(60),
    );
    let future = 4_000_000_000_000_000u64;
    for level in [
        1u64,
        6_048_000_001,
        509_969_032_671,
        219_717_778_959,
        238_309_671_103,
        604_799_999_999,
    ] {
        let stored = format!("{level}:{future}:{}:{}", week.rate, week.per_unit);
        let (code, remaining, _) = send_over(&call, &stored, &mut conn).await;
        let state = crate::budget::State::of(&week, level, future);
        let want = crate::budget::decide(&month, Some(state), future, 1);
        assert_eq!(
            (code == AdmitCode::Admitted, remaining as u64),
            (want.admitted(), want.remaining),
            "level {level}"
        );
        let stored: String = redis::cmd("GET")
            .arg(&call.budget)
            .query_async(&mut conn)
            .await
            .unwrap();
        let want_level = match want.state {
            Some(s) => s.level,
            // Refused: the level converted, stored again in the new budget's units.
            None => crate::budget::level_at(&month, Some(state), future),
        };
        assert_eq!(
            stored.split(':').next(),
            Some(want_level.to_string().as_str()),
            "level {level}"
        );
    }

    // Stored by an older build: "level:at_us:rate". 5 units of 10 an hour (1,800 s to empty),
    // dated in the future (so nothing drains), read as 10 a day (the same rate in ticks):
    // the same time until empty, 0.2 units of the day's. The same level with its ticks per
    // unit: 5 units.
    let req = request(62, limit(10, 24), vec![], 1);
    let call = admit_call(
        &req,
        Ask::default(),
        "t:legacy".into(),
        Duration::from_secs(60),
    );
    let future = 4_000_000_000_000_000u64;
    for (value, left) in [
        (format!("1800000000:{future}:1"), 8),
        (format!("1800000000:{future}:1:360000000"), 4),
    ] {
        let (code, remaining, _) = send_over(&call, &value, &mut conn).await;
        assert_eq!((code, remaining), (AdmitCode::Admitted, left), "{value}");
    }
}

/// A refund made once (`Refund::once`, a waiter's that left the queue) gives its units back
/// once however often it is sent (a resend of a call that timed out and may have run), and a
/// resend answers with the levels as they stand.
#[tokio::test]
async fn a_refund_made_once_is_made_once() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let req = request(64, limit, vec![], 4);
    let call = admit_call(
        &req,
        Ask::default(),
        "t:once".into(),
        Duration::from_secs(60),
    );
    assert_eq!(send(&call, false, &mut conn).await.1, 6);
    let other = admit_call(
        &req,
        Ask::default(),
        "t:other".into(),
        Duration::from_secs(60),
    );
    assert_eq!(send(&other, false, &mut conn).await.1, 2);
    let budgets = call.budgets();
    let marker = crate::store::redis::keys::refund_marker(&req.key, "t:once");
    let mut replies = vec![];
    for _ in 0..3 {
        let refund = Refund {
            budgets: &budgets,
            cost: 4,
            once: Some(&marker),
            record: None,
        };
        let levels: Vec<i64> = script::invoke(&refund.invocation(), &mut conn)
            .await
            .unwrap();
        replies.push(levels.len());
    }
    assert_eq!(replies, [1, 1, 1]);
    // 4 of the 8 given back once: the next admission of 1 leaves 5 (each send giving them
    // back left 9).
    let next = admit_call(
        &request(64, limit, vec![], 1),
        Ask::default(),
        "t:next".into(),
        Duration::from_secs(60),
    );
    assert_eq!(send(&next, false, &mut conn).await.1, 5);
}

/// A capped route's admission record, written with its charge for as long as the request may
/// wait and 120 s more: its refund, sent with the record and the time it surely lives until
/// (from the admission's own answer), gives the units back while Redis still holds the
/// charge, and nothing once Redis lost it with its data -- the units charged since (the
/// fallback's write-back of the same request, run while Redis was away) stay charged; after
/// that time, as without the record. Without the record it gave them back.
#[tokio::test]
async fn a_queued_charges_refund_gives_back_only_what_redis_still_holds() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let lease = Duration::from_secs(10);
    // The call, what it left, and Redis's time when it ran.
    let charge = async |conn: &mut Conn, req: &AdmitRequest, id: &str| {
        let call = admit_call(req, Ask::default(), id.into(), lease);
        let r = script::invoke::<Packed>(&call.invocation(), conn)
            .await
            .unwrap()
            .one()
            .unwrap();
        (call, r[2], r[5] as u64)
    };
    let admit = async |conn: &mut Conn, req: &AdmitRequest, id: &str| -> (AdmitCall, i64) {
        let (call, left, _) = charge(conn, req, id).await;
        (call, left)
    };
    // A queue_timeout of 30 s: the record lives 150 s, and surely until (Redis's time then)
    // + 149 s.
    let kept = async |conn: &mut Conn, call: &AdmitCall, at: u64| -> u64 {
        let life: i64 = redis::cmd("PTTL")
            .arg(&call.record)
            .query_async(conn)
            .await
            .unwrap();
        assert!((149_000..=150_000).contains(&life), "kept {life} ms");
        let until = script::record_lives_until(at, Duration::from_secs(150));
        assert_eq!(until, at + 149_000_000);
        until
    };
    let refund = async |conn: &mut Conn, key: u8, call: &AdmitCall, until_us: u64| {
        let budgets = call.budgets();
        let marker = crate::store::redis::keys::refund_marker(&[key; 32], &call.lease_id);
        let refund = Refund {
            budgets: &budgets,
            cost: 4,
            once: Some(&marker),
            record: Some((&call.record, until_us)),
        };
        let _: Vec<i64> = script::invoke(&refund.invocation(), conn).await.unwrap();
    };
    for (key, also) in [(70u8, false), (71, true)] {
        let extra = also.then(|| Extra {
            bucket: Bucket::Key("day".into()),
            limit: Limit::new(1000, Duration::from_secs(86400), Duration::ZERO).unwrap(),
        });
        let req = AdmitRequest {
            also: extra.into_iter().collect(),
            route_cap: Some(1),
            queue_timeout: Duration::from_secs(30),
            ..request(key, limit, vec![], 4)
        };
        let probe = |id: String| (request(key, limit, vec![], 1), id);
        // Redis holds the charge: given back.
        let (call, left, at) = charge(&mut conn, &req, "t:q1").await;
        assert_eq!(left, 6);
        let until = kept(&mut conn, &call, at).await;
        refund(&mut conn, key, &call, until).await;
        let (p, id) = probe(format!("t:p{key}"));
        assert_eq!(admit(&mut conn, &p, &id).await.1, 9);
        // Charged, then Redis loses its data, then the fallback's write-back charges the
        // same request again (here: an admission of 4): the refund gives nothing back.
        let (lost, left, at) = charge(&mut conn, &req, "t:q2").await;
        assert_eq!(left, 5);
        let until = kept(&mut conn, &lost, at).await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
        let written_back = request(key, limit, vec![], 4);
        assert_eq!(
            admit(&mut conn, &written_back, &format!("t:w{key}"))
                .await
                .1,
            6
        );
        refund(&mut conn, key, &lost, until).await;
        let (p, id) = probe(format!("t:x{key}"));
        assert_eq!(
            admit(&mut conn, &p, &id).await.1,
            5,
            "the write-back stays charged"
        );
        // Past the time the record was kept until, a record missing may have lapsed: the
        // refund is made as with the marker alone.
        let (late, left) = admit(&mut conn, &req, "t:q3").await;
        assert_eq!(left, 1);
        let _: () = redis::cmd("DEL")
            .arg(&late.record)
            .query_async(&mut conn)
            .await
            .unwrap();
        refund(&mut conn, key, &late, 1).await;
        let (p, id) = probe(format!("t:y{key}"));
        assert_eq!(admit(&mut conn, &p, &id).await.1, 4);
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    }
}

/// A queued request whose charge Redis lost with its data is charged again before it waits
/// again (`Recharge`), once however often that is sent; not if its record is there (Redis
/// kept its data), nor once its refund was made (a re-charge delivered late), nor past the
/// time its record was kept until.
#[tokio::test]
async fn a_lost_queued_charge_is_made_again_once() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let req = AdmitRequest {
        route_cap: Some(1),
        queue_timeout: Duration::from_secs(30),
        ..request(72, limit, vec![], 4)
    };
    let lease = Duration::from_secs(10);
    let call = admit_call(&req, Ask::default(), "t:r1".into(), lease);
    assert_eq!(send(&call, false, &mut conn).await.1, 6);
    let budgets = call.budgets();
    let marker = crate::store::redis::keys::refund_marker(&req.key, "t:r1");
    let until = |us: u64| script::Recharge {
        budgets: &budgets,
        cost: 4,
        record: &call.record,
        marker: &marker,
        record_ms: 150_000,
        until_us: us,
    };
    let far = u64::MAX / 2;
    let again = async |conn: &mut Conn, r: &script::Recharge<'_>| {
        let _: i64 = script::invoke(&r.invocation(), conn).await.unwrap();
    };
    let probe = |id: &str| {
        admit_call(
            &request(72, limit, vec![], 1),
            Ask::default(),
            id.into(),
            lease,
        )
    };
    // Redis kept it: nothing more.
    again(&mut conn, &until(far)).await;
    assert_eq!(send(&probe("t:p1"), false, &mut conn).await.1, 5);
    // Redis lost it: made again, once.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    again(&mut conn, &until(far)).await;
    again(&mut conn, &until(far)).await;
    assert_eq!(send(&probe("t:p2"), false, &mut conn).await.1, 5);
    // Lost, but past the time its record was kept until: not made (it may have lapsed).
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    again(&mut conn, &until(1)).await;
    assert_eq!(send(&probe("t:p3"), false, &mut conn).await.1, 9);
    // Lost, and its refund ran first (it found nothing to give back): a re-charge delivered
    // after it makes nothing.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let refund = Refund {
        budgets: &budgets,
        cost: 4,
        once: Some(&marker),
        record: Some((&call.record, far)),
    };
    let _: Vec<i64> = script::invoke(&refund.invocation(), &mut conn)
        .await
        .unwrap();
    again(&mut conn, &until(far)).await;
    assert_eq!(send(&probe("t:p4"), false, &mut conn).await.1, 9);
}

/// A capped route's charge is recorded for its `queue_timeout` and 120 s more whatever its
/// budgets (its refund must find the record while the request may wait), through `admit_one`
/// and `admit`; another charge's record lives only until its budgets are full again.
#[tokio::test]
async fn a_capped_charges_record_lives_whatever_its_budgets() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    // Full again within a millisecond.
    let fast = Limit::new(1_000_000, Duration::from_secs(1), Duration::ZERO).unwrap();
    let lease = Duration::from_secs(10);
    for general in [false, true] {
        for (capped, id) in [(true, "t:c"), (false, "t:u")] {
            let req = AdmitRequest {
                route_cap: capped.then_some(1),
                queue_timeout: Duration::from_secs(45),
                ..request(73 + general as u8, fast, vec![], 1)
            };
            let call = admit_call(&req, Ask::default(), format!("{id}{general}"), lease);
            send(&call, general, &mut conn).await;
            let life: i64 = redis::cmd("PTTL")
                .arg(&call.record)
                .query_async(&mut conn)
                .await
                .unwrap();
            if capped {
                assert!((164_000..=165_000).contains(&life), "capped: {life} ms");
            } else {
                assert!(life <= 1_000, "uncapped: {life} ms");
            }
        }
    }
}
