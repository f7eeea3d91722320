use super::*;
use std::sync::Arc;

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
    }
}

fn keys() -> Vec<(String, Limit)> {
    vec![("t{x}b".into(), limit(1, Duration::from_secs(1)))]
}

/// Redis's side of `admit`, transcribed from the Lua (one request, its slice and give-back)
/// over `budgets` at `now_us`: whether it admitted, and what the reply says.
fn redis_admit(
    budgets: &mut [(Limit, Option<State>)],
    now_us: u64,
    cost: u64,
    ask: Ask,
) -> (bool, Seen) {
    let mut levels: Vec<u64> = budgets
        .iter()
        .map(|(l, s)| budget::level_at(l, *s, now_us))
        .collect();
    for ((l, s), lv) in budgets.iter_mut().zip(levels.iter_mut()) {
        *lv = lv.saturating_sub(ask.give_back * l.per_unit);
        *s = Some(State {
            level: *lv,
            at_us: now_us,
            rate: l.rate,
        });
    }
    let fits = budgets
        .iter()
        .zip(&levels)
        .all(|((l, _), lv)| lv + cost * l.per_unit <= l.capacity);
    let mut seen = Seen {
        now_us,
        ..Seen::default()
    };
    if !fits {
        for (i, lv) in levels.iter().enumerate() {
            seen.levels[i] = *lv;
        }
        return (false, seen);
    }
    let grant = ask.slice > 0
        && budgets
            .iter()
            .zip(&levels)
            .all(|((l, _), lv)| lv + (cost + ask.slice + floor(l)) * l.per_unit <= l.capacity);
    seen.granted = if grant { ask.slice } else { 0 };
    for (i, ((l, s), lv)) in budgets.iter_mut().zip(&levels).enumerate() {
        let next = lv + (cost + seen.granted) * l.per_unit;
        *s = Some(State {
            level: next,
            at_us: now_us,
            rate: l.rate,
        });
        seen.levels[i] = next;
    }
    (true, seen)
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
/// lifetime.
#[test]
fn slices_start_exact_double_while_busy_and_halve_when_left_over() {
    let s = Slices::new(2);
    // 1600 units: at most 100 per slice with two instances.
    let r = req(limit(1600, Duration::from_secs(3600)), 3);
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    assert_eq!(s.spend(&r, t0), None, "nothing reserved yet");
    let ask = s.ask(&r, t0);
    assert_eq!(
        (ask.slice, ask.give_back),
        (0, 0),
        "the first call is exact"
    );
    let seen = Seen {
        now_us: 1,
        ..Seen::default()
    };
    assert!(s.settle(&r, ask, &seen, true, t0, keys).is_some());
    let mut sizes = vec![];
    for i in 1..8 {
        let now = ms(i);
        assert_eq!(s.spend(&r, now), None, "slice spent");
        let ask = s.ask(&r, now);
        sizes.push(ask.slice);
        let granted = Seen {
            granted: ask.slice,
            now_us: 1 + i,
            ..Seen::default()
        };
        s.settle(&r, ask, &granted, true, now, keys);
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
    assert_eq!((ask.slice, ask.give_back), (100, 100 % 3));
    let meanwhile = s.ask(&r, ms(10));
    assert_eq!((meanwhile.slice, meanwhile.give_back), (0, 0));
    assert!(!meanwhile.asker);
    s.settle(
        &r,
        ask,
        &Seen {
            granted: 100,
            now_us: 20,
            ..Seen::default()
        },
        true,
        ms(10),
        keys,
    );
    assert!(s.spend(&r, ms(11)).is_some());
    assert_eq!(s.unspent(&r.key, &r.limit), 97);
    // Failed unrun (the breaker open) while the slice is live: what it gave back is still
    // this instance's, within the slice's own lifetime.
    for _ in 0..32 {
        s.spend(&r, ms(12));
    }
    assert_eq!(s.unspent(&r.key, &r.limit), 1);
    let ask = s.ask(&r, ms(12));
    assert_eq!(ask.give_back, 1);
    s.failed(&r, ask, false, ms(12));
    assert_eq!(s.unspent(&r.key, &r.limit), 1);
    // Failed, perhaps run: it counts as given; the next one may ask again.
    let ask = s.ask(&r, ms(12));
    assert_eq!(ask.give_back, 1);
    s.failed(&r, ask, true, ms(12));
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    // A new slice; past its lifetime it is not spent, and the next reservation gives it
    // back and halves.
    let ask = s.ask(&r, ms(13));
    s.settle(
        &r,
        ask,
        &Seen {
            granted: ask.slice,
            now_us: 30,
            ..Seen::default()
        },
        true,
        ms(13),
        keys,
    );
    assert!(s.spend(&r, ms(13)).is_some());
    let left = s.unspent(&r.key, &r.limit);
    let late = ms(13) + LIFETIME;
    assert_eq!(s.spend(&r, late), None);
    let ask = s.ask(&r, late);
    assert_eq!(ask.give_back, left);
    // Failed unrun past the lifetime: Redis still holds the units, but they are never spent
    // here again (a failed call cannot renew a slice): the sweeper gives them back.
    s.failed(&r, ask, false, late);
    assert_eq!(s.unspent(&r.key, &r.limit), 0);
    assert!(s.sweep(late).iter().any(|((_, units), _)| *units == left));
    assert!(s.ask(&r, late).asker);
}

/// A changed budget (a reload) never spends an old slice: the slice goes back, by the sweeper,
/// as do idle keys' expired ones; `hand_back_all` empties the table.
#[test]
fn a_changed_budget_or_an_idle_key_gives_its_slice_back() {
    let s = Slices::new(1);
    let old = req(limit(1600, Duration::from_secs(3600)), 1);
    let t0 = Instant::now();
    let grant = |slice| Seen {
        granted: slice,
        now_us: 1,
        ..Seen::default()
    };
    let ask = s.ask(&old, t0);
    s.settle(&old, ask, &grant(0), true, t0, keys);
    let ask = s.ask(&old, t0);
    s.settle(&old, ask, &grant(ask.slice), true, t0, keys);
    s.settle(&old, Ask::default(), &grant(9), true, t0, keys);
    assert_eq!(
        s.unspent(&old.key, &old.limit),
        10,
        "crossing grants add up"
    );
    let new = req(limit(800, Duration::from_secs(3600)), 1);
    assert_eq!(s.spend(&new, t0), None);
    let ask = s.ask(&new, t0);
    assert_eq!(ask.slice, 0, "a new budget starts exact");
    s.settle(&new, ask, &grant(0), true, t0, keys);
    let swept = s.sweep(t0);
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].0 .1, 10);
    assert!(!s.stop_sweeping(), "the new key's entry is still there");
    // Idle past its lifetime: swept, with what it did not spend.
    let ask = s.ask(&new, t0);
    s.settle(&new, ask, &grant(ask.slice), true, t0, keys);
    assert_eq!(s.sweep(t0 + LIFETIME / 2).len(), 0, "still live");
    let swept = s.sweep(t0 + LIFETIME);
    assert_eq!(swept.iter().map(|g| g.0 .1).collect::<Vec<_>>(), [1]);
    assert!(s.start_sweeping());
    assert!(s.stop_sweeping(), "nothing left");
    // A reload takes everything out at once.
    let ask = s.ask(&new, t0);
    s.settle(&new, ask, &grant(5), true, t0, keys);
    s.retire_all();
    assert_eq!(s.spend(&new, t0), None);
    assert_eq!(s.hand_back_all().iter().map(|g| g.1).sum::<u64>(), 5);
}

/// One instance: the headers of sliced requests (spent here or reserved) are exactly those
/// of the exact path, request by request — with a slow budget and with one that drains
/// between requests, on one budget and on two.
#[test]
fn a_single_instance_shows_the_exact_paths_headers() {
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
        let s = Slices::new(1);
        let mut exact: Vec<(Limit, Option<State>)> = limits.iter().map(|l| (*l, None)).collect();
        let mut sliced = exact.clone();
        let t0 = Instant::now();
        let base_us = 5_000_000u64;
        let mut calls = 0;
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
                Some(o) => o,
                None => {
                    calls += 1;
                    let ask = s.ask(&r, now);
                    let (admitted, seen) = redis_admit(&mut sliced, now_us, cost, ask);
                    assert!(admitted, "request {i}");
                    s.settle(&r, ask, &seen, admitted, now, keys).unwrap()
                }
            };
            assert!(want.outcome.admitted(), "request {i}");
            assert_eq!(
                (got.remaining, got.reset_us, got.each),
                (
                    want.outcome.remaining,
                    want.outcome.reset_us,
                    want.outcome.each
                ),
                "request {i} of {limits:?}"
            );
        }
        assert!(
            calls < 100,
            "slices were used: {calls} calls for 400 requests"
        );
    }
}

/// Near the end of a budget every request is exact again: no slice is granted below the
/// floor, and none is held there.
#[test]
fn no_slice_below_the_floor() {
    let l = limit(400, Duration::from_secs(3600 * 720));
    let r = req(l, 1);
    let s = Slices::new(1);
    let mut redis = vec![(l, None)];
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
        let (ok, seen) = redis_admit(&mut redis, 1 + 100 * i, 1, ask);
        s.settle(&r, ask, &seen, ok, now, keys);
        admitted += ok as u64;
        let left_in_redis = l.remaining(seen.levels[0]);
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
    let s = Slices::new(6);
    let r = req(limit(120, Duration::from_secs(60)), 3);
    let t0 = Instant::now();
    for i in 0..10 {
        let now = t0 + Duration::from_millis(i);
        assert_eq!(s.spend(&r, now), None);
        let ask = s.ask(&r, now);
        assert_eq!((ask.slice, ask.give_back), (0, 0), "request {i}");
        let seen = Seen {
            now_us: 1 + i,
            ..Seen::default()
        };
        s.settle(&r, ask, &seen, true, now, keys);
    }
}
