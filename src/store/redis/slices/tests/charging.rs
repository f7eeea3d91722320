//! What sliced requests are charged and shown: never more generous than the exact path,
//! no burst swollen by a held slice, holds settled once, refunds and failed reservations
//! given back.

use super::*;

/// One instance: the headers of sliced requests (spent here or reserved) are never more
/// generous than the exact path's, request by request, and behind it by no more than what
/// a slice's lifetime drains — exactly the same on a budget that does not drain during the
/// test; on one budget and on two.
#[test]
fn a_single_instance_shows_the_exact_paths_headers_or_a_little_less() {
    let hour = Duration::from_secs(3600);
    let cases: Vec<(Limit, Vec<Extra>, u64)> = vec![
        (limit(2000, hour * 720), vec![], 3),
        (limit(1000, Duration::from_secs(10)), vec![], 1),
        (
            limit(1000, hour * 720),
            vec![Extra {
                bucket: Bucket::Key(Arc::from("minute")),
                limit: limit(1200, Duration::from_secs(60)),
            }],
            2,
        ),
    ];
    for (first, also, cost) in cases {
        let r = AdmitRequest {
            also: also.clone(),
            ..req(first, cost)
        };
        let limits: Vec<Limit> = r.limits().copied().collect();
        // Units one slice lifetime drains from the decisive budget, and one for rounding.
        let slack = |f: &Figures, remaining_of_first: bool| {
            let l = if remaining_of_first || also.is_empty() {
                limits[0]
            } else {
                limits[f.decisive as usize]
            };
            (l.rate * LIFETIME.as_micros() as u64).div_ceil(l.per_unit) + 1
        };
        let s = Slices::new(1, 1);
        let mut exact: Vec<(Limit, Option<State>)> = limits.iter().map(|l| (*l, None)).collect();
        let mut redis = Model::new(&limits);
        let t0 = Instant::now();
        let base_us = 5_000_000u64;
        let mut calls = 0;
        let mut behind = 0;
        for i in 0..400u64 {
            let now = t0 + Duration::from_micros(700 * i);
            let now_us = base_us + 700 * i;
            let budgets: Vec<_> = exact.iter().map(|(l, s)| (*l, *s)).collect();
            let want = budget::decide_all(&budgets, now_us, cost);
            for (b, st) in exact.iter_mut().zip(want.states) {
                if st.is_some() {
                    b.1 = st;
                }
            }
            let got = match s.spend(&r, now) {
                Some((o, _)) => o,
                None => {
                    calls += 1;
                    let ask = s.ask(&r, now);
                    let (admitted, seen) = redis.admit(now_us, cost, ask);
                    assert!(admitted, "request {i}");
                    s.settle(&r, ask, &seen, admitted, now, place).unwrap()
                }
            };
            assert!(want.outcome.admitted(), "request {i}");
            let (w, g) = (want.outcome.remaining, got.remaining);
            assert!(g <= w, "request {i} of {limits:?}: {g} left > exact {w}");
            assert!(
                w - g <= slack(&got.each, true),
                "request {i} of {limits:?}: {g} left, exact {w}"
            );
            assert!(got.reset_us >= want.outcome.reset_us, "request {i}");
            for (gf, wf) in got.each.as_slice().iter().zip(want.outcome.each.as_slice()) {
                assert!(gf.remaining <= wf.remaining, "request {i}");
            }
            behind = behind.max(w - g);
        }
        if limits
            .iter()
            .all(|l| l.rate * LIFETIME.as_micros() as u64 <= l.per_unit)
        {
            assert!(
                behind <= 1,
                "no drain, no difference but rounding: {behind}"
            );
        }
        assert!(
            calls < 100,
            "slices were used: {calls} calls for 400 requests"
        );
    }
}

/// The review's case: 100 units/s, an instance holds a slice while the bucket drains, then
/// a burst on two instances. Every unit is charged before it drains, so no window admits
/// more than the bucket and its refill: the burst gets `max_cost`, not `max_cost` + the
/// slice.
#[test]
fn a_slice_held_through_a_quiet_spell_does_not_swell_a_burst() {
    let l = limit(100, Duration::from_secs(1));
    let r = req(l, 1);
    let (a, b) = (Slices::new(1, 1), Slices::new(1, 2));
    let mut redis = Model::new(&[l]);
    let t0 = Instant::now();
    let at = |us: u64| (t0 + Duration::from_micros(us), us + 1_000_000);
    // A warms up at 50 requests/s (slower than the refill) until its slice is the cap, 12.
    let mut us = 0;
    let mut admitted_a = 0;
    let admit = |s: &Slices, redis: &mut Model, us: u64| -> bool {
        let (now, now_us) = at(us);
        if s.spend(&r, now).is_some() {
            return true;
        }
        let ask = s.ask(&r, now);
        let (ok, seen) = redis.admit(now_us, 1, ask);
        s.settle(&r, ask, &seen, ok, now, place);
        ok
    };
    while a.unspent(&r.key, &l) < 10 {
        assert!(admit(&a, &mut redis, us));
        admitted_a += 1;
        us += 20_000;
        assert!(admitted_a < 200, "a slice was granted");
    }
    let held = a.unspent(&r.key, &l);
    // Quiet for 400 ms: the bucket's own level drains away, the hold does not.
    us += 400_000;
    // The burst, within 1 ms: B asks first, then A spends what it holds, then both go on.
    let start = us;
    let mut burst = 0;
    for i in 0..300 {
        let s = if i % 2 == 0 { &b } else { &a };
        if admit(s, &mut redis, us) {
            burst += 1;
        }
        us += 3;
    }
    let refill = (us - start) * 100 / 1_000_000 + 1;
    assert!(held >= 10, "A held {held}");
    assert!(
        burst <= 100 + refill,
        "a burst of {burst} > bucket 100 + refill {refill} (A held {held})"
    );
    assert!(burst >= 100 - held, "the bucket was near full: {burst}");
}

/// Settling is idempotent, a dead instance's hold is charged in full once it expires (a
/// settling that still comes gives back what was not spent), and a settled hold charges what
/// was spent of it.
#[test]
fn holds_settle_once_and_expire_as_spent() {
    let l = limit(1000, Duration::from_secs(3600 * 720));
    let mut redis = Model::new(&[l]);
    let level = |m: &Model, us| budget::level_at(&l, m.budgets[0].1, us).div_ceil(l.per_unit);
    let ask = |grant, settle, unspent| Ask {
        slice: 50,
        grant,
        settle,
        unspent,
        ..Ask::default()
    };
    let (ok, seen) = redis.admit(1, 1, ask(7, 0, 0));
    assert!(ok);
    assert_eq!((seen.granted, level(&redis, 1)), (50, 1));
    assert_eq!(l.remaining(seen.levels[0] + seen.held[0]), 1000 - 51);
    let s = Settle {
        place: place(),
        id: 7,
        unspent: 20,
        granted: Grant::default(),
    };
    redis.settle(&s, 2);
    assert_eq!(level(&redis, 2), 31);
    redis.settle(&s, 3);
    assert_eq!(level(&redis, 3), 31, "settled once");
    // Another hold, never settled: charged in full after HOLD_TTL.
    let (ok, _) = redis.admit(4, 1, ask(8, 0, 0));
    assert!(ok);
    let after = 4 + HOLD_TTL.as_micros() as u64;
    let (_, seen) = redis.admit(after, 1, Ask::default());
    assert_eq!(level(&redis, after), 31 + 1 + 50 + 1);
    assert_eq!(seen.held[0], 0);
    // Its instance was alive after all, and its settling only late (an outage outlasted the
    // hold): the 40 of the 50 it did not spend come back, once.
    let late = Settle::unspent(place(), 8, 40);
    redis.settle(&late, after + 1);
    assert_eq!(level(&redis, after + 1), 31 + 1 + 10 + 1);
    redis.settle(&late, after + 2);
    assert_eq!(level(&redis, after + 2), 31 + 1 + 10 + 1, "given back once");
}

/// A late settling gives back only what is left of the expiry's full charge: units that
/// drained since stand for other requests' charges now, and giving them back would let a
/// burst pass the bucket.
#[test]
fn a_late_settling_gives_back_only_what_has_not_drained() {
    // 100 units a second drain.
    let l = limit(1000, Duration::from_secs(10));
    let mut redis = Model::new(&[l]);
    let level = |m: &Model, us| budget::level_at(&l, m.budgets[0].1, us).div_ceil(l.per_unit);
    let grant = Ask {
        slice: 50,
        grant: 8,
        ..Ask::default()
    };
    assert!(redis.admit(1, 1, grant).0);
    // Expired unsettled: charged in full (the first unit has drained by then).
    let after = 1 + HOLD_TTL.as_micros() as u64;
    assert!(redis.admit(after, 1, Ask::default()).0);
    assert_eq!(level(&redis, after), 51);
    // 400 ms later (40 units drained) another request is charged 20...
    assert!(redis.admit(after + 400_000, 20, Ask::default()).0);
    assert_eq!(level(&redis, after + 400_000), 31);
    // ... and 500 ms after the expiry (the 50 drained) the settling comes: 40 not spent, but
    // none of the expiry's charge is left to give back. The 21 are that request's and the
    // last one's.
    let late = Settle::unspent(place(), 8, 40);
    redis.settle(&late, after + 500_000);
    assert_eq!(level(&redis, after + 500_000), 21);
}

/// A request spent from a slice and refunded (its upstream failed) is never charged: its
/// cost goes back into the slice while that is the key's hold here, to the hold in Redis
/// while it is being settled, and to the budget once it was.
#[test]
fn a_refunded_request_from_a_slice_is_never_charged() {
    let l = limit(1000, Duration::from_secs(3600 * 720));
    let r = req(l, 1);
    let s = Slices::new(1, 1);
    let mut redis = Model::new(&[l]);
    let t0 = Instant::now();
    let mut admitted = 0;
    let call = |s: &Slices, redis: &mut Model, i: u64| {
        let ask = s.ask(&r, t0);
        let (ok, seen) = redis.admit(1 + i, 1, ask);
        s.settle(&r, ask, &seen, ok, t0, place);
        ask
    };
    call(&s, &mut redis, 0);
    call(&s, &mut redis, 1);
    admitted += 2;
    let held = s.unspent(&r.key, &l);
    assert!(held > 0);
    // Spent and refunded while the hold is this instance's: back into the slice.
    let (_, hold) = s.spend(&r, t0).unwrap();
    assert!(
        !s.unspend(&r, hold, t0 + LIFETIME),
        "past its life: Redis may charge it as expired first"
    );
    assert!(s.unspend(&r, hold, t0));
    assert_eq!(s.unspent(&r.key, &l), held);
    // Spent, then the hold is being settled (the next reservation took it) when the refund
    // comes: it goes to the hold in Redis, and the settling charges it no more.
    let (_, hold) = s.spend(&r, t0).unwrap();
    admitted += 1;
    let _ = s.spend(&r, t0).map(|_| admitted += 1);
    let ask = s.ask(&r, t0);
    assert_eq!(ask.settle, hold);
    assert!(
        !s.unspend(&r, hold, t0),
        "not this instance's to give back any more"
    );
    redis.unspend(hold, 1, 3);
    admitted -= 1;
    let (ok, seen) = redis.admit(4, 1, ask);
    assert!(ok);
    admitted += 1;
    s.settle(&r, ask, &seen, ok, t0, place);
    let unspent = s.unspent(&r.key, &l);
    assert_eq!(
        redis.taken(5),
        admitted + unspent,
        "charged: what was admitted, and the slice"
    );
    // Refunded after its hold was settled: to the budget.
    redis.unspend(hold, 1, 6);
    admitted -= 1;
    assert_eq!(redis.taken(6), admitted + unspent);
}

/// A reservation that failed unrun gives its hold back to this instance only within the
/// hold's own lifetime, and an entry that replaced its own (a reload) keeps its reservation.
#[test]
fn a_failed_reservation_restores_its_hold_only_while_it_lives() {
    let s = Slices::new(1, 1);
    let r = req(limit(1600, Duration::from_secs(3600)), 1);
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let grant = |ask: Ask| Seen {
        granted: ask.slice,
        now_us: 1,
        ..Seen::default()
    };
    let ask = s.ask(&r, t0);
    s.settle(&r, ask, &grant(ask), true, t0, place);
    let first = s.ask(&r, t0);
    s.settle(&r, first, &grant(first), true, t0, place);
    assert!(first.slice > 0);
    // A takes the hold at 400 ms; a reload; C starts a new entry at 450 ms.
    let a = s.ask(&r, ms(400));
    assert_eq!(a.settle, first.grant);
    s.retire_all();
    let c = s.ask(&r, ms(450));
    assert!(c.asker);
    // A fails unrun at 600 ms, past the hold's life (from 0 ms): the sweeper settles it.
    s.failed(&r, a, false, ms(600), place());
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    let swept: Vec<_> = s
        .sweep(ms(600))
        .into_iter()
        .map(|(x, _)| (x.id, x.unspent))
        .collect();
    assert!(swept.contains(&(first.grant, a.unspent)), "{swept:?}");
    assert!(!s.ask(&r, ms(600)).asker, "C is still reserving");
    // C's request goes away before its answer: what it may be granted is settled, and the
    // key stays "reserving" until that lifetime ends (the call may still grant a slice).
    s.abandoned(&r, c, ms(600), place());
    assert!(!s.ask(&r, ms(700)).asker);
    assert!(s.ask(&r, ms(950)).asker);
}
