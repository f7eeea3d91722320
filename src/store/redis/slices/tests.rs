use super::*;
use std::sync::Arc;

mod model;
use model::Model;

fn limit(max_cost: u64, window: Duration) -> Limit {
    Limit::new(max_cost, window, Duration::ZERO).unwrap()
}

fn req(limit: Limit, cost: u64) -> AdmitRequest {
    AdmitRequest {
        key: [7; 32],
        limit,
        also: vec![],
        cost,
        key_cap: None,
        route: Arc::from("r"),
        route_cap: None,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

fn place() -> Place {
    Place {
        holds: "t{x}h".into(),
        budgets: vec![("t{x}b".into(), limit(1, Duration::from_secs(1)))],
    }
}

#[test]
fn only_requests_without_caps_shared_budgets_or_delays_take_part() {
    let l = limit(1000, Duration::from_secs(60));
    assert!(eligible(&req(l, 1)));
    let capped = AdmitRequest {
        route_cap: Some(5),
        ..req(l, 1)
    };
    assert!(!eligible(&capped));
    let key_capped = AdmitRequest {
        key_cap: Some(5),
        ..req(l, 1)
    };
    assert!(!eligible(&key_capped));
    let mut shared = req(l, 1);
    shared.also.push(Extra {
        bucket: Bucket::Route(Arc::from("/p")),
        limit: l,
    });
    assert!(!eligible(&shared));
    let mut two = req(l, 1);
    two.also.push(Extra {
        bucket: Bucket::Key(Arc::from("day")),
        limit: l,
    });
    assert!(eligible(&two));
    let delayed = req(
        Limit::new(1000, Duration::from_secs(60), Duration::from_secs(1)).unwrap(),
        1,
    );
    assert!(!eligible(&delayed));
}

/// First exact, then from the cost up, doubling while slices run out fast, capped at
/// max_cost / (8 × fleet_size); halving when one expires unspent; never spent past its
/// lifetime; each call settles the key's last hold.
#[test]
fn slices_start_exact_double_while_busy_and_halve_when_left_over() {
    let s = Slices::new(2, 9);
    // 1600 units: at most 100 per slice with two instances.
    let r = req(limit(1600, Duration::from_secs(3600)), 3);
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let grant = |ask: Ask, now_us| Seen {
        granted: ask.slice,
        now_us,
        ..Seen::default()
    };
    assert_eq!(s.spend(&r, t0), None, "nothing reserved yet");
    let ask = s.ask(&r, t0);
    assert_eq!((ask.slice, ask.settle), (0, 0), "the first call is exact");
    assert!(s.settle(&r, ask, &grant(ask, 1), true, t0, place).is_some());
    let mut sizes = vec![];
    let mut last = 0;
    for i in 1..8 {
        let now = ms(i);
        assert_eq!(s.spend(&r, now), None, "slice spent");
        let ask = s.ask(&r, now);
        sizes.push(ask.slice);
        assert_eq!(ask.settle, last, "the last hold is settled");
        assert_eq!(ask.grant >> 64, 9, "hold ids carry the instance");
        assert_ne!(ask.grant, last);
        last = ask.grant;
        s.settle(&r, ask, &grant(ask, 1 + i), true, now, place);
        // Spend it all (3 units a request) but what is less than a cost.
        let mut spent = 0;
        while s.spend(&r, now).is_some() {
            spent += 3;
        }
        assert_eq!(spent, ask.slice / 3 * 3);
    }
    assert_eq!(sizes, [3, 6, 12, 24, 48, 96, 100]);
    // A reservation while another is in flight is decided exactly: one slice per key here.
    let ask = s.ask(&r, ms(10));
    assert_eq!((ask.slice, ask.settle, ask.unspent), (100, last, 100 % 3));
    let meanwhile = s.ask(&r, ms(10));
    assert_eq!(
        (meanwhile.slice, meanwhile.settle, meanwhile.unspent),
        (0, 0, 0)
    );
    assert!(!meanwhile.asker);
    s.settle(&r, ask, &grant(ask, 20), true, ms(10), place);
    assert!(s.spend(&r, ms(11)).is_some());
    assert_eq!(s.unspent(&r.key, &r.limit), 97);
    // Failed unrun (the breaker open) while the slice is live: the hold is still this
    // instance's, within its own lifetime, and nothing is settled.
    for _ in 0..32 {
        s.spend(&r, ms(12));
    }
    assert_eq!(s.unspent(&r.key, &r.limit), 1);
    let held = ask.grant;
    let ask = s.ask(&r, ms(12));
    assert_eq!((ask.settle, ask.unspent), (held, 1));
    s.failed(&r, ask, false, ms(12), place());
    assert_eq!(s.unspent(&r.key, &r.limit), 1);
    assert!(s.sweep(ms(12)).is_empty());
    // Failed, perhaps run: not spent here any more; the hold it settled and the one it may
    // have granted are settled again by the sweeper (a no-op for what did run).
    let ask = s.ask(&r, ms(12));
    assert_eq!((ask.settle, ask.unspent), (held, 1));
    s.failed(&r, ask, true, ms(12), place());
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    let again: Vec<(HoldId, u64)> = s
        .sweep(ms(12))
        .iter()
        .map(|(x, _)| (x.id, x.unspent))
        .collect();
    assert_eq!(again, [(held, 1), (ask.grant, ask.slice)]);
    // A new slice; past its lifetime it is not spent, and the next reservation settles it
    // and halves.
    let ask = s.ask(&r, ms(13));
    s.settle(&r, ask, &grant(ask, 30), true, ms(14), place);
    assert!(s.spend(&r, ms(14)).is_some());
    let left = s.unspent(&r.key, &r.limit);
    // Its life runs from the ask, not from the answer.
    let late = ms(13) + LIFETIME;
    assert_eq!(s.spend(&r, late), None);
    let next = s.ask(&r, late);
    assert_eq!((next.settle, next.unspent), (ask.grant, left));
    assert_eq!(next.slice, ask.slice / 2);
    // Failed unrun past the lifetime: Redis still holds it, but it is never spent here
    // again (a failed call cannot renew a slice): the sweeper settles it.
    s.failed(&r, next, false, late, place());
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    let swept = s.sweep(late);
    assert!(swept
        .iter()
        .any(|(x, _)| (x.id, x.unspent) == (ask.grant, left)));
    assert!(s.ask(&r, late).asker);
}

/// A changed budget (a reload) never spends an old slice: its hold is settled by the
/// sweeper, as are idle keys' expired ones (spent or not); `hand_back_all` empties the table.
#[test]
fn a_changed_budget_or_an_idle_key_settles_its_slice() {
    let s = Slices::new(1, 1);
    let old = req(limit(1600, Duration::from_secs(3600)), 1);
    let t0 = Instant::now();
    let grant = |slice| Seen {
        granted: slice,
        now_us: 1,
        ..Seen::default()
    };
    let ask = s.ask(&old, t0);
    s.settle(&old, ask, &grant(0), true, t0, place);
    let first = s.ask(&old, t0);
    s.settle(&old, first, &grant(first.slice), true, t0, place);
    assert_eq!(s.unspent(&old.key, &old.limit), 1);
    let new = req(limit(800, Duration::from_secs(3600)), 1);
    assert_eq!(s.spend(&new, t0), None);
    let ask = s.ask(&new, t0);
    assert_eq!((ask.slice, ask.settle), (0, 0), "a new budget starts exact");
    s.settle(&new, ask, &grant(0), true, t0, place);
    let swept = s.sweep(t0);
    assert_eq!(swept.len(), 1);
    assert_eq!((swept[0].0.id, swept[0].0.unspent), (first.grant, 1));
    assert_eq!(swept[0].0.place, place());
    assert!(!s.stop_sweeping(), "the new key's entry is still there");
    // Idle past its lifetime: swept, spent (unspent 0) or not.
    let ask = s.ask(&new, t0);
    s.settle(&new, ask, &grant(ask.slice), true, t0, place);
    assert!(s.spend(&new, t0).is_some());
    assert_eq!(s.sweep(t0 + LIFETIME / 2).len(), 0, "still live");
    let swept = s.sweep(t0 + LIFETIME);
    assert_eq!(
        swept
            .iter()
            .map(|(x, _)| (x.id, x.unspent))
            .collect::<Vec<_>>(),
        [(ask.grant, 0)]
    );
    assert!(s.start_sweeping());
    assert!(s.stop_sweeping(), "nothing left");
    // A reload takes everything out at once.
    let ask = s.ask(&new, t0);
    s.settle(&new, ask, &grant(0), true, t0, place);
    let ask = s.ask(&new, t0);
    s.settle(&new, ask, &grant(ask.slice), true, t0, place);
    s.retire_all();
    assert_eq!(s.spend(&new, t0), None);
    let all = s.hand_back_all();
    assert_eq!(
        all.iter().map(|x| (x.id, x.unspent)).collect::<Vec<_>>(),
        [(ask.grant, ask.slice)]
    );
}

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

/// Near the end of a budget every request is exact again: no slice is granted below the
/// floor, and none is held there.
#[test]
fn no_slice_below_the_floor() {
    let l = limit(400, Duration::from_secs(3600 * 720));
    let r = req(l, 1);
    let s = Slices::new(1, 1);
    let mut redis = Model::new(&[l]);
    let t0 = Instant::now();
    let mut admitted = 0;
    let mut held_below_floor = 0;
    for i in 0..500u64 {
        let now = t0 + Duration::from_micros(100 * i);
        if s.spend(&r, now).is_some() {
            admitted += 1;
            continue;
        }
        let ask = s.ask(&r, now);
        let (ok, seen) = redis.admit(1 + 100 * i, 1, ask);
        s.settle(&r, ask, &seen, ok, now, place);
        admitted += ok as u64;
        let left_in_redis = l.remaining(seen.levels[0] + seen.held[0]);
        if left_in_redis < floor(&l) && s.unspent(&r.key, &l) > 0 {
            held_below_floor += 1;
        }
    }
    assert_eq!(admitted, 400, "every unit, and not one more");
    assert_eq!(held_below_floor, 0);
}

/// Settling is idempotent, a dead instance's hold is charged in full once it expires, and
/// a settled hold charges what was spent of it.
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

/// A budget too small for a slice of one request's cost (`max_cost / (8 × fleet_size)`
/// below it) stays exact: one call per request, nothing held.
#[test]
fn no_slice_smaller_than_the_cost() {
    // 120 units, six instances: slices of at most 2 units, and a request costs 3.
    let s = Slices::new(6, 1);
    let r = req(limit(120, Duration::from_secs(60)), 3);
    let t0 = Instant::now();
    for i in 0..10 {
        let now = t0 + Duration::from_millis(i);
        assert_eq!(s.spend(&r, now), None);
        let ask = s.ask(&r, now);
        assert_eq!((ask.slice, ask.settle, ask.grant), (0, 0, 0), "request {i}");
        let seen = Seen {
            now_us: 1 + i,
            ..Seen::default()
        };
        s.settle(&r, ask, &seen, true, now, place);
    }
}
