use super::*;

fn cfg() -> Config {
    Config::parse(
        &DEMO_CONFIG
            .replace("{listen}", "127.0.0.1:1")
            .replace("{admin}", "127.0.0.1:2")
            .replace("{upstream}", "127.0.0.1:3"),
        &EnvOverrides::default(),
    )
    .unwrap()
}

#[test]
fn check_table() {
    let t = route_table(&cfg());
    assert!(
        t.contains("/reports/generate  20    5              1s"),
        "{t}"
    );
    assert!(
        t.contains("default            1     -              -"),
        "{t}"
    );
    assert!(t.contains("default  120       1m"), "{t}");
}

#[test]
fn explain_text() {
    let (t, ok) = explain(&cfg(), "post", "/x/../reports//generate", Some("k"));
    assert!(ok);
    assert!(t.contains("normalized:   /reports/generate"), "{t}");
    assert!(t.contains("route:        /reports/generate"), "{t}");
    assert!(t.contains("cost:         20"), "{t}");
    assert!(
        t.contains("= 6 such requests in a burst, then one every 10.0 s"),
        "{t}"
    );
    // A fast refill in the unit that shows it (`0.0 s` before).
    let (t, _) = explain(&cfg(), "GET", "/items/1", Some("k"));
    assert!(t.contains("then one every 500.0 ms"), "{t}");
    let (t, ok) = explain(&cfg(), "GET", "/a%2fb", None);
    assert!(!ok && t.contains("400 bad-path"), "{t}");
    let (t, _) = explain(&cfg(), "GET", "/items/1", None);
    assert!(t.contains("401"), "{t}");
    assert!(!t.contains("mode:") && !t.contains("per second"), "{t}");
    let timed = Config::parse(
        &DEMO_CONFIG
            .replace("{listen}", "127.0.0.1:1")
            .replace("{admin}", "127.0.0.1:2")
            .replace("{upstream}", "127.0.0.1:3")
            .replace(
                "      cost: 1\n",
                "      cost: 1\n      cost_per_second: 4\n      mode: shadow\n",
            ),
        &EnvOverrides::default(),
    )
    .unwrap();
    let (t, _) = explain(&timed, "GET", "/items/1", Some("k"));
    assert!(
        t.contains("then 4 per second of upstream time, at least 1 in total"),
        "{t}"
    );
    assert!(t.contains("mode:         shadow"), "{t}");
    // The demo's analytics route settles on what the sample API states.
    let (t, _) = explain(&cfg(), "GET", "/analytics/query", Some("k"));
    assert!(t.contains("cost:         10\n"), "{t}");
    assert!(
        t.contains("              settled to what the upstream states in x-actual-cost (0 to 1000 units), when it does"),
        "{t}"
    );
}
