use super::*;

fn histo(samples: &[f64]) -> Histogram {
    let bounds = crate::telemetry::LATENCY_BUCKETS;
    Histogram {
        count: samples.len() as u64,
        sum: samples.iter().sum(),
        buckets: bounds
            .iter()
            .map(|&le| Bucket {
                le,
                count: samples.iter().filter(|s| **s <= le).count() as u64,
            })
            .collect(),
    }
}

fn route(name: &str, cost: u64, samples: &[f64]) -> RouteAudit {
    RouteAudit {
        route: name.into(),
        requests: samples.len() as u64,
        cost,
        cost_per_second: None,
        mode: "enforce".into(),
        upstream: histo(samples),
        p50_seconds: None,
        p95_seconds: None,
        mean_seconds: None,
        stated: None,
    }
}

fn instance(routes: Vec<RouteAudit>) -> InstanceAudit {
    InstanceAudit {
        version: "t".into(),
        config_hash: "h".into(),
        instance: String::new(),
        routes,
        plans: vec![PlanAudit {
            name: "default".into(),
            budgets: vec![BudgetAudit {
                name: "default".into(),
                max_cost: 120,
                window_seconds: 60.0,
            }],
        }],
    }
}

#[test]
fn quantiles_interpolate_like_prometheus() {
    // 10 samples in (0.005, 0.01], 10 in (0.25, 0.5].
    let h = histo(&[[0.008; 10], [0.3; 10]].concat());
    // rank 10 of 20: the top of the (0.005, 0.01] bucket.
    assert!((h.quantile(0.5).unwrap() - 0.01).abs() < 1e-12);
    // rank 19: 9/10 of the way through (0.25, 0.5].
    assert!((h.quantile(0.95).unwrap() - 0.475).abs() < 1e-12);
    assert_eq!(h.quantile(0.5).map(|_| ()), Some(()));
    assert_eq!(Histogram::default().quantile(0.5), None);
    // Past the last finite bucket: that bound.
    assert_eq!(histo(&[100.0; 4]).quantile(0.5), Some(60.0));
}

#[test]
fn merging_adds_counts_and_reads_percentiles_from_the_sum() {
    // Instance A: all fast; B: all slow. Averaging their p95s would say ~0.25 s; the
    // merged buckets say the slow half dominates the p95.
    let a = instance(vec![route("/r", 1, &[0.004; 30])]);
    let b = instance(vec![
        route("/r", 1, &[0.9; 30]),
        route("/only-b", 1, &[0.1]),
    ]);
    let m = merge(&[a.clone(), b.clone()]).unwrap();
    let r = &m.routes[0];
    assert_eq!((r.requests, r.upstream.count), (60, 60));
    assert!((r.upstream.sum - (30.0 * 0.004 + 30.0 * 0.9)).abs() < 1e-9);
    assert!((r.mean_seconds.unwrap() - 0.452).abs() < 1e-9);
    let p95 = r.p95_seconds.unwrap();
    assert!(p95 > 0.5 && p95 <= 1.0, "{p95}");
    let avg_of_p95s = (a.routes[0].upstream.quantile(0.95).unwrap()
        + b.routes[0].upstream.quantile(0.95).unwrap())
        / 2.0;
    assert!(p95 > avg_of_p95s);
    for (x, y) in r.upstream.buckets.iter().zip(&a.routes[0].upstream.buckets) {
        assert!(x.count >= y.count);
    }
    assert_eq!(m.routes[1].route, "/only-b");
    // Different buckets cannot be merged exactly: an error, not a guess.
    let mut c = b.clone();
    c.routes[0].upstream.buckets.pop();
    assert_eq!(
        merge(&[a, c]).unwrap_err(),
        MergeError::Buckets { route: "/r".into() }
    );
}

#[test]
fn implied_cost_flags_and_worst_case() {
    let fleet = merge(&[instance(vec![
        route("/a", 1, &[0.010; 40]),
        route("/b", 1, &[0.010; 40]),
        route("/slow", 1, &[0.300; 40]),
        route("/priced", 30, &[0.300; 40]),
        route("/dear", 20, &[0.010; 40]),
        route("/quiet", 5, &[1.0; 19]),
    ])])
    .unwrap();
    let r = report(&fleet, None);
    // Median of the cost-1 means (0.01, 0.01, 0.3) is 0.01 s.
    assert!((r.baseline_seconds.unwrap() - 0.01).abs() < 1e-12);
    let by = |n: &str| r.routes.iter().find(|f| f.route == n).unwrap();
    let slow = by("/slow");
    assert!((slow.implied_cost.unwrap() - 30.0).abs() < 1e-9);
    assert_eq!(slow.flag, Some("under-priced"));
    // 120 / 1 × 60 / 60 × 0.3 s = 36 backend-seconds per minute.
    assert_eq!(slow.worst_case.len(), 1);
    assert!((slow.worst_case[0].backend_seconds_per_minute - 36.0).abs() < 1e-9);
    assert_eq!(by("/priced").flag, None);
    assert!((by("/priced").worst_case[0].backend_seconds_per_minute - 1.2).abs() < 1e-9);
    assert_eq!(by("/dear").flag, Some("over-priced"));
    assert_eq!(by("/a").flag, None);
    let quiet = by("/quiet");
    assert!(quiet.too_little_traffic);
    assert_eq!((quiet.implied_cost, quiet.mean_seconds), (None, None));
    assert!(quiet.worst_case.is_empty());
    // Worst first, the quiet route last.
    assert_eq!(r.routes[0].route, "/slow");
    assert_eq!(r.routes.last().unwrap().route, "/quiet");
    let t = render_table(&r);
    assert!(t.contains("too little traffic (19 < 20)"), "{t}");
    assert!(t.contains("!! under-priced"), "{t}");
}

#[test]
fn tightest_budget_binds_and_time_prices_count() {
    let plan = PlanAudit {
        name: "pro".into(),
        budgets: vec![
            BudgetAudit {
                name: "minute".into(),
                max_cost: 120,
                window_seconds: 60.0,
            },
            BudgetAudit {
                name: "day".into(),
                max_cost: 20_000,
                window_seconds: 86_400.0,
            },
        ],
    };
    let w = worst_case(&plan, 1.0, 0.5).unwrap();
    assert_eq!(w.budget, "day");
    assert!((w.backend_seconds_per_minute - 20_000.0 * 60.0 / 86_400.0 * 0.5).abs() < 1e-9);
    // A time-priced route costs what its mean time costs when that is more.
    assert_eq!(effective_cost(1, Some(4.0), 1.4), 6.0);
    assert_eq!(effective_cost(10, Some(4.0), 1.4), 10.0);
    assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), Some(2.5));
}

/// A plan of several budgets is audited against each (the tightest binds), not only its
/// first: `pro`'s day budget of 150 allows far less backend time than its minute's 100.
#[test]
fn every_budget_of_a_plan_is_audited() {
    let text = "upstream: {url: \"http://127.0.0.1:1\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\nplans:\n  pro:\n    budgets:\n      - {name: minute, max_cost: 100, window: 60s}\n      - {name: day, max_cost: 150, window: 24h}\n";
    let cfg = crate::config::Config::parse(text, &crate::config::EnvOverrides::default()).unwrap();
    let plans = plans_of(&cfg);
    let pro = plans.iter().find(|p| p.name == "pro").unwrap();
    let names: Vec<&str> = pro.budgets.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["pro-minute", "pro-day"]);
    let w = worst_case(pro, 1.0, 0.0695).unwrap();
    assert_eq!(w.budget, "pro-day");
    assert!((w.backend_seconds_per_minute - 150.0 * 60.0 / 86_400.0 * 0.0695).abs() < 1e-9);
    // A plan of one budget keeps its own name.
    assert_eq!(plans[0].budgets[0].name, "default");
}

/// Audited against a file (`tollgate audit -c`), the routes are the file's: one it removed is
/// not priced by the instances' old config, one it adds shows with too little traffic. (The
/// route set was the instances'.)
#[test]
fn a_file_audits_its_own_routes() {
    let fleet = instance(vec![
        route("/kept", 1, &[0.01; 30]),
        route("/removed", 50, &[0.5; 30]),
        route("default", 1, &[0.01; 30]),
    ]);
    let text = "upstream: {url: \"http://127.0.0.1:1\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n  endpoints:\n    /kept: {cost: 2}\n    /brandnew: {cost: 7}\n";
    let cfg = crate::config::Config::parse(text, &crate::config::EnvOverrides::default()).unwrap();
    let r = report(&fleet, Some(&cfg));
    let mut seen: Vec<(&str, u64, bool)> = r
        .routes
        .iter()
        .map(|f| (f.route.as_str(), f.cost, f.too_little_traffic))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("/brandnew", 7, true),
            ("/kept", 2, false),
            ("default", 1, false)
        ]
    );
}

/// A `cost_per_second` route's worst case is DESIGN §6's formula on its configured cost,
/// `max_cost / cost × 60 / window_seconds × mean`, as for any route (its price flag compares
/// what it bills on average, its time's cost when more). (It divided by that average bill,
/// ceil(mean × cost_per_second): 100.4 where the formula gives 150.6.)
#[test]
fn a_time_priced_routes_worst_case_is_the_formulas() {
    let mut timed = route("/timed", 2, &[0.502; 40]);
    timed.cost_per_second = Some(4.0);
    let mut i = instance(vec![route("/a", 1, &[0.010; 40]), timed]);
    i.plans[0].budgets[0].max_cost = 600;
    let r = report(&merge(&[i]).unwrap(), None);
    let timed = r.routes.iter().find(|f| f.route == "/timed").unwrap();
    let mean = timed.mean_seconds.unwrap();
    let want = 600.0 / 2.0 * 60.0 / 60.0 * mean;
    assert!(
        (timed.worst_case[0].backend_seconds_per_minute - want).abs() < 1e-9,
        "{} for {want}",
        timed.worst_case[0].backend_seconds_per_minute
    );
}
