use super::*;

fn lim(max_cost: u64, window_ms: u64, delay_ms: u64) -> Limit {
    Limit::new(
        max_cost,
        Duration::from_millis(window_ms),
        Duration::from_millis(delay_ms),
    )
    .unwrap()
}

/// Runs `n` requests of `cost` at the same instant; returns what each saw.
fn burst(l: &Limit, n: usize, cost: u64, now: u64) -> (Vec<Outcome>, Option<State>) {
    let mut st = None;
    let mut out = vec![];
    for _ in 0..n {
        let o = decide(l, st, now, cost);
        if let Some(s) = o.state {
            st = Some(s);
        }
        out.push(o);
    }
    (out, st)
}

#[test]
fn incident_six_reports_then_429() {
    let l = lim(120, 60_000, 0);
    assert_eq!((l.per_unit, l.rate, l.capacity), (500_000, 1, 60_000_000));
    let (out, _) = burst(&l, 60, 20, 1_000_000);
    let remaining: Vec<u64> = out.iter().take(6).map(|o| o.remaining).collect();
    assert_eq!(remaining, vec![100, 80, 60, 40, 20, 0]);
    assert!(out[..6]
        .iter()
        .all(|o| o.verdict == Verdict::Admit { delay_us: 0 }));
    for o in &out[6..] {
        assert_eq!(
            o.verdict,
            Verdict::Reject {
                retry_after_us: 10_000_000
            }
        );
        assert_eq!(o.state, None, "a rejection writes nothing");
        assert_eq!(o.remaining, 0);
        assert_eq!(o.reset_us, 60_000_000);
    }
    assert_eq!(retry_after_secs(10_000_000), 10);
}

#[test]
fn refills_at_rate() {
    let l = lim(120, 60_000, 0);
    let (_, st) = burst(&l, 6, 20, 0);
    // 2 units/s: after 9.999999 s a cost-20 request still doesn't fit, after 10 s it does.
    let o = decide(&l, st, 9_999_999, 20);
    assert_eq!(o.verdict, Verdict::Reject { retry_after_us: 1 });
    let o = decide(&l, st, 10_000_000, 20);
    assert!(o.admitted());
    assert_eq!(o.remaining, 0);
    // A full window later the bucket is empty again: the whole burst passes.
    let (out, _) = burst(&l, 7, 20, 60_000_000);
    assert_eq!(out.iter().filter(|o| o.admitted()).count(), 6);
}

#[test]
fn sustained_throughput_never_exceeds_rate() {
    let l = lim(7, 1_000, 0); // 7 per second: p/q = 1e6/7, not a whole number of µs
    let mut st = None;
    let mut admitted = 0u64;
    // One request every 50 µs for 10 s.
    for t in (0..10_000_000u64).step_by(50) {
        let o = decide(&l, st, t, 1);
        if o.admitted() {
            admitted += 1;
            st = o.state;
        }
    }
    // burst (7) + 7/s × 10 s, and no rounding slack either way.
    assert_eq!(admitted, 7 + 69);
}

#[test]
fn extreme_fast_rate_is_exact() {
    let l = lim(100_000_000, 1_000, 0);
    assert_eq!((l.per_unit, l.rate), (1, 100));
    let (out, st) = burst(&l, 3, 50_000_000, 0);
    assert!(out[0].admitted() && out[1].admitted());
    assert_eq!(out[1].remaining, 0);
    assert_eq!(
        out[2].verdict,
        Verdict::Reject {
            retry_after_us: 500_000
        }
    );
    // 1 µs later exactly 100 units have drained.
    let o = decide(&l, st, 1, 100);
    assert!(o.admitted());
    assert_eq!(o.remaining, 0);
    assert!(!decide(&l, st, 1, 101).admitted());
    // Reset is 1 s: never a zero TTL that Redis would reject.
    assert_eq!(o.reset_us, 1_000_000);
}

#[test]
fn extreme_slow_rate() {
    let l = lim(1, 3_600_000, 0);
    let (out, st) = burst(&l, 2, 1, 5);
    assert!(out[0].admitted());
    assert_eq!(
        out[1].verdict,
        Verdict::Reject {
            retry_after_us: 3_600_000_000
        }
    );
    assert_eq!(retry_after_secs(3_600_000_000), 3600);
    assert!(!decide(&l, st, 3_600_000_004, 1).admitted());
    assert!(decide(&l, st, 3_600_000_005, 1).admitted());
}

#[test]
fn unrepresentable_rate_is_a_config_error() {
    // 999_999_937 (prime) per 1h: p/q doesn't reduce, capacity ≈ 3.6e18 ticks.
    assert!(Limit::new(999_999_937, Duration::from_secs(3600), Duration::ZERO).is_err());
    assert!(Limit::new(100_000_000, Duration::from_secs(1), Duration::ZERO).is_ok());
}

#[test]
fn max_delay_reserves_and_holds() {
    let l = lim(120, 60_000, 10_000);
    let (out, _) = burst(&l, 8, 20, 0);
    assert!(out[..6]
        .iter()
        .all(|o| o.verdict == Verdict::Admit { delay_us: 0 }));
    // The 7th fits within 10 s of waiting: reserved, held 10 s.
    assert_eq!(
        out[6].verdict,
        Verdict::Admit {
            delay_us: 10_000_000
        }
    );
    assert_eq!(out[6].remaining, 0);
    // The 8th would wait 20 s > max_delay: rejected, retry when its wait would be ≤ 10 s.
    assert_eq!(
        out[7].verdict,
        Verdict::Reject {
            retry_after_us: 10_000_000
        }
    );
}

#[test]
fn refund_restores_units() {
    let l = lim(120, 60_000, 0);
    let (_, st) = burst(&l, 6, 20, 0);
    let st = refund(&l, st, 0, 20);
    let o = decide(&l, st, 0, 20);
    assert!(o.admitted());
    assert_eq!(refund(&l, None, 0, 20), None);
}

#[test]
fn clock_going_backwards_does_not_panic_or_refill() {
    let l = lim(120, 60_000, 0);
    let (_, st) = burst(&l, 6, 20, 1_000_000);
    assert!(!decide(&l, st, 0, 1).admitted());
}

#[test]
fn a_reloaded_budget_carries_the_units_spent() {
    let minute = lim(120, 60_000, 0);
    let (_, spent) = burst(&minute, 6, 20, 0); // all 120 units
                                               // The window becomes an hour: still no room (keeping the time until empty, 60 s of an
                                               // hour's drain, left 118 units).
    let hour = lim(120, 3_600_000, 0);
    let o = decide(&hour, spent, 0, 1);
    assert!(!o.admitted());
    assert_eq!(o.remaining, 0);
    // One unit drains in 30 s at the new rate.
    assert!(!decide(&hour, spent, 29_999_999, 1).admitted());
    assert!(decide(&hour, spent, 30_000_000, 1).admitted());
    // Twice the units a minute: exactly 120 left.
    let double = lim(240, 60_000, 0);
    assert_eq!(decide(&double, spent, 0, 1).remaining, 119);
    let mut st = spent;
    let mut admitted = 0;
    for _ in 0..7 {
        let o = decide(&double, st, 0, 20);
        if o.admitted() {
            admitted += 1;
            st = o.state;
        }
    }
    assert_eq!(admitted, 6);
    // Half the units: in debt by 60, which drains at 1 unit a second.
    let half = lim(60, 60_000, 0);
    assert_eq!(level_at(&half, spent, 0), 120 * half.per_unit);
    assert!(!decide(&half, spent, 60_999_999, 1).admitted());
    assert!(decide(&half, spent, 61_000_000, 1).admitted());
    // A state converted and stored again is in the new budget's ticks.
    let o = decide(&double, spent, 0, 20);
    assert_eq!(o.state.unwrap().per_unit, double.per_unit);
}

#[test]
fn a_state_stored_without_its_ticks_per_unit_keeps_its_time_to_empty() {
    let old = lim(120, 60_000, 0);
    let (_, st) = burst(&old, 3, 20, 0); // half full: 30 s to empty
    let legacy = st.map(|s| State { per_unit: 0, ..s });
    let new = lim(7, 1_000, 0);
    let lvl = level_at(&new, legacy, 0);
    assert_eq!(div_ceil(lvl, new.rate), 30_000_000);
}

#[test]
fn debit_goes_into_debt() {
    let l = lim(120, 60_000, 0);
    let (_, st) = burst(&l, 6, 20, 0);
    let st = Some(debit(&l, st, 0, 30));
    let o = decide(&l, st, 0, 1);
    assert_eq!(o.remaining, 0);
    // 30 units of debt at 2 units/s: a cost-1 request fits after 15.5 s, not before.
    assert!(!decide(&l, st, 15_499_999, 1).admitted());
    assert!(decide(&l, st, 15_500_000, 1).admitted());
}

#[test]
fn local_fraction() {
    let l = lim(120, 60_000, 0).fraction(6);
    assert_eq!(l.max_cost(), 20);
    let (out, _) = burst(&l, 3, 10, 0);
    assert_eq!(out.iter().filter(|o| o.admitted()).count(), 2);
}

#[test]
fn several_budgets_all_or_nothing() {
    let minute = lim(3, 60_000, 0);
    let day = lim(4, 86_400_000, 0);
    let mut st = [None, None];
    let mut admitted = 0;
    for _ in 0..3 {
        let j = decide_all(&[(minute, st[0]), (day, st[1])], 0, 1);
        assert!(j.outcome.admitted());
        admitted += 1;
        st = [j.states[0], j.states[1]];
    }
    assert_eq!(admitted, 3);
    // The minute budget is the tightest now (0 left against the day's 1).
    let j = decide_all(&[(minute, st[0]), (day, st[1])], 0, 1);
    assert!(!j.outcome.admitted());
    assert_eq!(j.outcome.each.decisive, 0);
    assert_eq!(j.states, [None; MAX_BUDGETS], "a refusal writes nothing");
    // A minute later the minute budget has room, the day budget one unit only.
    let j = decide_all(&[(minute, st[0]), (day, st[1])], 60_000_000, 2);
    assert_eq!(j.outcome.each.decisive, 1, "the day budget refuses");
    let Verdict::Reject { retry_after_us } = j.outcome.verdict else {
        panic!()
    };
    assert!(retry_after_us > 3_600_000_000, "hours: {retry_after_us}");
    let figs = j.outcome.each.as_slice();
    assert_eq!(figs.len(), 2);
    assert_eq!((figs[0].remaining, figs[1].remaining), (3, 1));
    assert_eq!(j.outcome.remaining, 1);
    let j = decide_all(&[(minute, st[0]), (day, st[1])], 60_000_000, 1);
    assert!(j.outcome.admitted());
    assert_eq!(
        j.outcome.each.decisive, 1,
        "tightest: the day budget, 0 left"
    );
    assert!(j.states[0].is_some() && j.states[1].is_some());
}

#[test]
fn several_budgets_wait_for_the_slowest() {
    let a = lim(1, 500, 30_000);
    let b = lim(10, 1_000, 0);
    let (_, sa) = burst(&a, 1, 1, 0);
    let j = decide_all(&[(a, sa), (b, None)], 0, 1);
    assert_eq!(j.outcome.verdict, Verdict::Admit { delay_us: 500_000 });
    // One budget is exactly `decide`.
    let one = decide_all(&[(b, None)], 0, 1);
    assert_eq!(one.outcome, decide(&b, None, 0, 1));
    assert!(one.outcome.each.as_slice().is_empty());
}

/// The figures of an admission with its charge given back (a refund's answer) are those of
/// the bucket the refund leaves, as of the admission (its reset within the 1 µs the figures
/// round to, and 0 when it empties): for assorted levels, costs and limits, against `refund`
/// and `uncharged` computed on the state itself.
#[test]
fn given_back_figures_are_the_refunded_buckets() {
    for l in [
        lim(120, 60_000, 0),
        lim(7, 3_600_000, 0),
        lim(100, 1_000, 500),
        lim(1_000, 86_400_000, 0),
        // Two units a µs, and just under one with max_delay (a level past capacity).
        lim(2_000_000, 1_000, 0),
        lim(999_999, 1_000, 300),
    ] {
        for (n, cost, at) in [
            (0, 1, 0),
            (1, 1, 5),
            (3, 20, 1_234),
            (5, 7, 999_999),
            (2, 100, 50),
            (1, 999_999, 7),
            (2, 700_000, 3),
            // Full to the last unit, and past it (held by max_delay): none left.
            (1, 1_000_000, 0),
            (1, 600_000, 1),
        ] {
            let now = 1_000_000_000 + at;
            let (_, before) = burst(&l, n, cost, now);
            let o = decide(&l, before, now, cost);
            if !o.admitted() {
                continue;
            }
            let exact = uncharged(&l, refund(&l, o.state, now, cost), now, o.verdict);
            let got = l.given_back(
                Figure {
                    remaining: o.remaining,
                    reset_us: o.reset_us,
                },
                cost,
            );
            // Exact; past capacity never more than are left, and at most one unit a µs of
            // rate fewer (the figures round the level to whole µs).
            let fewer = exact.remaining - got.remaining.min(exact.remaining);
            let bound = l.rate.div_ceil(l.per_unit);
            assert!(
                got.remaining <= exact.remaining
                    && (fewer == 0 || (o.remaining == 0 && fewer <= bound)),
                "{l:?}, {n} × {cost} before: {} left, exactly {}",
                got.remaining,
                exact.remaining
            );
            assert!(
                got.reset_us.abs_diff(exact.reset_us) <= 1
                    && (exact.reset_us > 0 || got.reset_us == 0),
                "{l:?}, {n} × {cost} before: {} µs, exactly {}",
                got.reset_us,
                exact.reset_us
            );
        }
    }
}

/// Budgets with as few units left as each other: the one full again last speaks for them
/// (`X-RateLimit-Reset` is when all of them are), not the first. A request that empties a
/// 100/10s and a 100/100s budget said `X-RateLimit-Reset: 10`, when the second has 10 units
/// back then.
#[test]
fn of_equally_tight_budgets_the_one_full_last_speaks() {
    let fast = lim(100, 10_000, 0);
    let slow = lim(100, 100_000, 0);
    let j = decide_all(&[(fast, None), (slow, None)], 0, 100);
    assert!(j.outcome.admitted());
    assert_eq!(j.outcome.each.decisive, 1);
    assert_eq!((j.outcome.remaining, j.outcome.reset_us), (0, 100_000_000));
    // The other order: the same one.
    let j = decide_all(&[(slow, None), (fast, None)], 0, 100);
    assert_eq!(j.outcome.each.decisive, 0);
    assert_eq!(tightest([(3, 5), (2, 1), (2, 9), (2, 9)]), 2);
    assert_eq!(tightest([]), 0);
}

/// With several budgets each is given back, and the decisive one is the tightest again.
#[test]
fn given_back_on_several_budgets_names_the_tightest_again() {
    let minute = lim(120, 60_000, 0);
    let day = lim(200, 86_400_000, 0);
    let budgets = [(minute, None), (day, None)];
    let now = 1_000_000;
    // 110 of the day's 200 are spent (the minute's bucket is empty): 20 more leave the day
    // 70, the minute 100.
    let day_state = decide(&day, None, now, 110).state;
    let j = decide_all(&[budgets[0], (day, day_state)], now, 20);
    assert!(j.outcome.admitted());
    let standing = crate::store::Standing::from(&j.outcome);
    // The day (70 left) decides over the minute (100 left).
    assert_eq!((standing.remaining, standing.each.decisive), (70, 1));
    let back = standing.given_back([minute, day].iter(), 20);
    // Both 20 richer: the minute full (120), the day 90: still the day's.
    let each: Vec<u64> = back.each.as_slice().iter().map(|f| f.remaining).collect();
    assert_eq!(each, [120, 90]);
    assert_eq!((back.remaining, back.each.decisive), (90, 1));
    assert_eq!(back.each.as_slice()[0].reset_us, 0);
    // One budget: as Limit::given_back.
    let one = crate::store::Standing::from(&decide(&minute, None, now, 20));
    let back = one.given_back([minute].iter(), 20);
    assert_eq!((back.remaining, back.reset_us), (120, 0));
}
