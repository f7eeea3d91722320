//! Which requests take part, how big a slice is and how long it lives: its size follows the
//! key's pace, and a changed budget, an idle key or the budget's floor ends it.

use super::*;

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

/// A slice retired while its key's reservation is in flight (a charge beyond it: a stated
/// cost's debt) is not brought back by that reservation's answer: what it granted is settled
/// unspent, and the key's next entry starts exact.
#[test]
fn a_reservation_answered_after_its_slice_was_retired_grants_nothing_here() {
    let s = Slices::new(1, 9);
    let r = req(limit(1600, Duration::from_secs(3600)), 3);
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let first = s.ask(&r, t0);
    s.settle(&r, first, &grant(first, 1), true, t0, place);
    let asking = s.ask(&r, ms(1));
    assert!(asking.slice > 0);
    s.retire(&r.key);
    // The key's next request makes a new entry (exact) while the old reservation is out.
    let next = s.ask(&r, ms(2));
    assert_eq!(next.slice, 0, "a new entry's first call is exact");
    assert_eq!(
        s.settle(&r, asking, &grant(asking, 3), true, ms(3), place),
        None
    );
    assert_eq!(
        s.spend(&r, ms(4)),
        None,
        "nothing of the old grant is spent here"
    );
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    let settling: Vec<Settle> = s.hand_back_all();
    assert!(
        settling
            .iter()
            .any(|x| x.id == asking.grant && x.unspent == asking.slice),
        "{settling:?}"
    );
}
