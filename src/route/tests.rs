use std::borrow::Cow;

use super::path::is_canonical;
use super::*;

#[test]
fn normalization() {
    let ok = |p: &str| normalize_path(p).unwrap().into_owned();
    assert_eq!(ok("/reports/generate"), "/reports/generate");
    assert_eq!(ok("/reports//generate"), "/reports/generate");
    assert_eq!(ok("/reports/./generate"), "/reports/generate");
    assert_eq!(ok("/x/../reports/generate"), "/reports/generate");
    assert_eq!(ok("/reports/%67enerate"), "/reports/generate");
    assert_eq!(ok("/%2E%2E/reports/generate"), "/reports/generate");
    assert_eq!(ok("/reports/generate/"), "/reports/generate");
    assert_eq!(ok("/../../etc"), "/etc");
    assert_eq!(ok("/"), "/");
    assert_eq!(ok("//"), "/");
    assert_eq!(ok("/a/b/.."), "/a");
    assert_eq!(ok("/caf%c3%a9"), "/caf%C3%A9");
    assert_eq!(ok("/a%20b"), "/a%20b");
    // One spelling per character: raw UTF-8 is escaped as its percent-encoding is.
    assert_eq!(ok("/ünï"), "/%C3%BCn%C3%AF");
    assert_eq!(ok("/caf\u{e9}"), ok("/caf%c3%a9"));
}

/// A request's raw non-ASCII path and its escaped spelling are one route (`check` has the
/// pattern written escaped, the normalized form): before, a raw request path missed an escaped
/// pattern.
#[test]
fn non_ascii_paths_match_in_either_spelling() {
    let r = Router::new(
        vec![spec("/prices/%E2%82%AC", 7), spec("/caf%C3%A9/{id}", 8)],
        1,
    )
    .unwrap();
    let c = |p: &str| r.route_of("GET", p).unwrap().cost;
    let n = |p: &str| normalize_path(p).unwrap().into_owned();
    assert_eq!(c(&n("/prices/%E2%82%AC")), 7);
    assert_eq!(c(&n("/prices/%e2%82%ac")), 7);
    assert_eq!(c(&n("/prices/€")), 7);
    assert_eq!(c(&n("/café/1")), 8);
    assert_eq!(c(&n("/caf%c3%a9/1")), 8);
}

/// The escapes of `:`, `@` and the sub-delimiters but `;`, unescaped; None when there are
/// none.
#[test]
fn escaped_delimiters_unescaped() {
    let d = |p: &str| decode_delims(p);
    assert_eq!(d("/v1/r%3Agenerate").as_deref(), Some("/v1/r:generate"));
    assert_eq!(
        d("/a%2Bb%40c%21%24%26%27%28%29%2A%2C%3D").as_deref(),
        Some("/a+b@c!$&'()*,=")
    );
    assert_eq!(d("/a%3Bb%2Fc%25d%3F"), None);
    assert_eq!(d("/a%20b"), None);
    assert_eq!(d("/a/b"), None);
    assert_eq!(d("/a%3"), None);
}

/// A path whose escaped delimiter, unescaped, is another route is refused; one that is the
/// same route either way is that route.
#[test]
fn an_escaped_delimiter_that_spells_another_route_is_refused() {
    let r = Router::new(vec![spec("/v1/r:gen", 20), spec("/items/{id}", 3)], 1).unwrap();
    let route = |p: &str| r.route_of("GET", p).map(|r| r.cost);
    assert_eq!(route("/v1/r:gen"), Ok(20));
    assert_eq!(route("/v1/r%3Agen"), Err(BadPath::EscapedDelimiter));
    assert_eq!(route("/items/a%3Ab"), Ok(3));
    assert_eq!(route("/other%40x"), Ok(1));
}

/// A raw ASCII character that a path must hold escaped is its escape: one spelling, as for
/// non-ASCII bytes.
#[test]
fn ascii_a_path_must_escape_is_escaped() {
    for (raw, escaped) in [
        ("/q|x", "/q%7Cx"),
        ("/q%7cx", "/q%7Cx"),
        ("/a b", "/a%20b"),
        ("/a\"b'c", "/a%22b'c"),
        ("/{x}^[y]`<z>", "/%7Bx%7D%5E%5By%5D%60%3Cz%3E"),
    ] {
        assert_eq!(normalize_path(raw).unwrap(), escaped, "{raw}");
        assert!(!super::path::is_canonical(raw.as_bytes()), "{raw}");
    }
}

#[test]
fn canonical_fast_path_agrees() {
    for p in [
        "/",
        "/a",
        "/a/b",
        "/a.b/c",
        "/.well-known/x",
        "/a/..b",
        "/a/b..",
        "/a/.b/",
        "//",
        "/a//b",
        "/a/./b",
        "/a/../b",
        "/a/.",
        "/a/..",
        "/a/",
        "/.",
        "/..",
        "/a/b/c.d",
        "/...",
        "/é",
    ] {
        let fast = is_canonical(p.as_bytes());
        let slow = normalize_path(p).map(|c| c.into_owned());
        assert_eq!(fast, slow.as_deref() == Ok(p), "{p}: {slow:?}");
    }
}

#[test]
fn normalization_refusals() {
    let bad = |p: &str| normalize_path(p).unwrap_err();
    assert_eq!(bad("/reports%2fgenerate"), BadPath::EncodedSeparator);
    assert_eq!(bad("/reports%2Fgenerate"), BadPath::EncodedSeparator);
    assert_eq!(bad("/reports%5cgenerate"), BadPath::EncodedSeparator);
    assert_eq!(bad("/reports\\generate"), BadPath::Backslash);
    assert_eq!(bad("/reports%00"), BadPath::ControlChar);
    assert_eq!(bad("/reports%0a"), BadPath::ControlChar);
    assert_eq!(bad("/reports\u{7f}"), BadPath::ControlChar);
    assert_eq!(bad("/reports\t"), BadPath::ControlChar);
    assert_eq!(bad("/r%zz"), BadPath::BadEncoding);
    assert_eq!(bad("/r%2"), BadPath::BadEncoding);
    assert_eq!(bad("reports"), BadPath::NotAbsolute);
}

fn spec(p: &str, cost: u64) -> RouteSpec {
    RouteSpec {
        pattern: p.into(),
        cost,
        max_in_flight: None,
        queue_timeout: Duration::ZERO,
        queue: Default::default(),
        fidelity: Fidelity::default(),
        provider: Provider::default(),
        jobs: None,
    }
}

fn router() -> Router {
    Router::new(
        vec![
            spec("/reports/generate", 20),
            spec("GET /reports/{id}", 2),
            spec("/reports/{id}", 3),
            spec("/files/{*rest}", 4),
            spec("GET /files/{*rest}", 5),
            spec("/files/special", 6),
            spec("DELETE /reports/generate", 7),
            spec("/a/{x}/c", 8),
            spec("/a/b/{y}", 9),
        ],
        1,
    )
    .unwrap()
}

/// A `HEAD` is charged as the `GET` it stands for (most frameworks run the GET handler for
/// it), unless a `HEAD` endpoint says otherwise: else `HEAD` would reach an expensive GET's
/// handler at the default's price and past its cap.
#[test]
fn head_is_charged_as_get() {
    let r = router();
    let c = |m: &str, p: &str| r.classify(m, p).route.cost;
    assert_eq!(c("HEAD", "/reports/42"), 2);
    assert_eq!(c("HEAD", "/files/x/y"), 5);
    assert_eq!(c("HEAD", "/reports/generate"), 20, "method-less exact");
    let own = Router::new(
        vec![
            spec("GET /r/{id}", 9),
            spec("HEAD /r/{id}", 1),
            spec("HEAD /s/{id}", 1),
            spec("GET /s/x", 9),
        ],
        1,
    )
    .unwrap();
    assert_eq!(own.classify("HEAD", "/r/1").route.cost, 1, "HEAD's own");
    assert_eq!(
        own.classify("HEAD", "/s/x").route.cost,
        9,
        "the more specific GET"
    );
    assert_eq!(own.classify("HEAD", "/s/y").route.cost, 1);
    assert_eq!(own.classify("GET", "/s/y").route.cost, 1, "default");
}

#[test]
fn most_specific_wins() {
    let r = router();
    let c = |m: &str, p: &str| r.classify(m, p).route.cost;
    assert_eq!(c("POST", "/reports/generate"), 20);
    assert_eq!(
        c("GET", "/reports/generate"),
        20,
        "exact beats a METHOD template"
    );
    assert_eq!(
        c("DELETE", "/reports/generate"),
        7,
        "METHOD exact beats exact"
    );
    assert_eq!(
        c("GET", "/reports/42"),
        2,
        "METHOD beats method-less at equal shape"
    );
    assert_eq!(c("PUT", "/reports/42"), 3);
    assert_eq!(c("PUT", "/files/x/y/z"), 4);
    assert_eq!(c("GET", "/files/x/y"), 5);
    assert_eq!(c("GET", "/files/special"), 6, "exact beats a METHOD tail");
    assert_eq!(c("GET", "/a/b/c"), 9);
    assert_eq!(c("GET", "/nothing"), 1);
    assert_eq!(&*r.classify("GET", "/nothing").route.label, "default");
    assert_eq!(
        c("POST", "/Reports/GENERATE"),
        20,
        "case cannot dodge a cost"
    );
    assert_eq!(c("GET", "/reports/42/more"), 1);
}

/// A template and a tail under the same prefix are both endpoints (DESIGN §1: exact >
/// template > tail), with a method or without.
#[test]
fn a_template_and_a_tail_share_a_prefix() {
    let r = Router::new(
        vec![
            spec("/files/{id}", 2),
            spec("/files/{*path}", 3),
            spec("/files/x", 4),
            spec("/files/{id}/meta", 5),
            spec("POST /up/{id}", 6),
            spec("POST /up/{*rest}", 7),
            spec("/up/{*rest}", 8),
        ],
        1,
    )
    .unwrap();
    let c = |m: &str, p: &str| r.classify(m, p).route.cost;
    assert_eq!(c("GET", "/files/x"), 4);
    assert_eq!(c("GET", "/files/abc"), 2);
    assert_eq!(c("GET", "/files/abc/meta"), 5);
    assert_eq!(c("GET", "/files/a/b"), 3);
    assert_eq!(c("GET", "/files/abc/meta/more"), 3);
    assert_eq!(c("POST", "/up/1"), 6);
    assert_eq!(c("POST", "/up/1/2"), 7);
    assert_eq!(c("GET", "/up/1"), 8);
    assert_eq!(c("GET", "/files"), 1);
    // A real conflict names the endpoint it conflicts with, in the gateway's words.
    let e = Router::new(vec![spec("/x/{a}", 1), spec("/x/{b}", 1)], 1).unwrap_err();
    assert_eq!(e[0].1, "conflicts with the endpoint \"/x/{a}\"", "{e:?}");
    let e = Router::new(vec![spec("GET /Y/{a}", 1), spec("GET /y/{b}", 1)], 1).unwrap_err();
    assert_eq!(
        e[0].1, "conflicts with the endpoint \"GET /Y/{a}\"",
        "{e:?}"
    );
}

#[test]
fn pattern_errors() {
    let e = Router::new(vec![spec("reports", 1)], 1).unwrap_err();
    assert!(e[0].1.contains("must start with '/'"), "{e:?}");
    let e = Router::new(vec![spec("get /x", 1)], 1).unwrap_err();
    assert!(e[0].1.contains("upper-case method"), "{e:?}");
    let e = Router::new(vec![spec("/x/{a}", 1), spec("/x/{b}", 1)], 1).unwrap_err();
    assert!(e[0].0 == "/x/{b}" && e[0].1.contains("conflicts"), "{e:?}");
    let e = Router::new(vec![spec("/x//y", 1)], 1).unwrap_err();
    assert!(e[0].1.contains("normalized"), "{e:?}");
    let e = Router::new(vec![spec("/x/", 1)], 1).unwrap_err();
    assert!(e[0].1.contains("normalized"), "{e:?}");
    let e = Router::new(vec![spec("/X", 1), spec("/x", 1)], 1).unwrap_err();
    assert!(e[0].1.contains("conflicts"), "{e:?}");
}

#[test]
fn matrix_parameters_are_not_matched() {
    let m = |p: &str| match_path(p).map(|c| c.into_owned());
    assert_eq!(m("/reports/generate").as_deref(), Ok("/reports/generate"));
    assert_eq!(
        m("/reports/generate;x=1").as_deref(),
        Ok("/reports/generate")
    );
    assert_eq!(
        m("/reports;v=2/generate").as_deref(),
        Ok("/reports/generate")
    );
    assert_eq!(
        m("/reports/;x/generate").as_deref(),
        Ok("/reports/generate")
    );
    assert_eq!(
        m("/reports/.;x/generate").as_deref(),
        Ok("/reports/generate")
    );
    assert_eq!(m("/;x").as_deref(), Ok("/"));
    assert_eq!(m("/x/..;/reports"), Err(BadPath::DotDotParameter));
    assert_eq!(m("/x/..;y=1"), Err(BadPath::DotDotParameter));
    // Also where a later `..` would resolve it away before the parameters are looked at.
    for p in [
        "/x/..;/../reports/generate",
        "/a/b/..;x=1/../../reports/generate",
        "/x/%2e%2e;/../reports/generate",
        "/reports/generate/..;/..",
        "/..;/..",
    ] {
        let classified = normalize_path(p).and_then(|n| match_path(&n).map(|c| c.into_owned()));
        assert_eq!(classified, Err(BadPath::DotDotParameter), "{p}");
    }
    assert!(matches!(match_path("/a/b"), Ok(Cow::Borrowed(_))));
}

#[test]
fn case_folds_onto_ascii() {
    assert_eq!(fold_to_ascii("/reports/generate"), None);
    assert_eq!(fold_to_ascii("/caf%C3%A9"), None);
    assert_eq!(fold_to_ascii("/café"), None);
    assert_eq!(
        fold_to_ascii("/report%C5%BF/generate").as_deref(),
        Some("/reports/generate")
    );
    assert_eq!(
        fold_to_ascii("/analyt%C4%B1cs/query").as_deref(),
        Some("/analytics/query")
    );
    assert_eq!(fold_to_ascii("/analytıcs").as_deref(), Some("/analytics"));
    assert_eq!(fold_to_ascii("/%E2%84%AA").as_deref(), Some("/k"));
    assert_eq!(fold_to_ascii("/%EF%AC%81le").as_deref(), Some("/file"));
    // What does not fold keeps its spelling, escapes included.
    assert_eq!(
        fold_to_ascii("/caf%C3%A9/%C4%B1/%FF").as_deref(),
        Some("/caf%C3%A9/i/%FF")
    );
}

#[test]
fn suffixes_and_folds_in_the_router() {
    let r = Router::new(
        vec![spec("/reports/generate", 20), spec("/files/{name}", 2)],
        1,
    )
    .unwrap()
    .with_suffixes(&[".json".into(), ".XML".into()]);
    let c = |p: &str| r.route_of("POST", p).map(|r| r.cost);
    assert_eq!(c("/reports/generate.json"), Ok(20));
    assert_eq!(c("/reports/generate.xml;x=1"), Ok(20));
    assert_eq!(c("/reports/GENERATE.JSON"), Ok(20));
    assert_eq!(c("/reports/.json"), Ok(1));
    assert_eq!(c("/files/a.json"), Ok(2));
    assert_eq!(c("/report%C5%BF/generate"), Err(BadPath::CaseFold));
    assert_eq!(c("/files/%C4%B1"), Ok(2), "folded or not, the same route");
}

/// A queue keeps the figures of the latest loaded config (`Route::loaded_ms`): each config
/// loaded in a process is stamped after the one before, even within one millisecond (or
/// with the clock stepped back), so a reload always wins over the config it replaces.
#[test]
fn each_config_loaded_is_stamped_after_the_one_before() {
    let stamps: Vec<u64> = (0..3)
        .map(|_| Router::new(vec![], 1).unwrap().default_route().loaded_ms)
        .collect();
    assert!(stamps[0] < stamps[1] && stamps[1] < stamps[2], "{stamps:?}");
}

/// A reload lists the routes whose cap it took away, or whose route it took away with its
/// cap: their waiters go at once (`Store::reloaded`). A route still capped (whatever its new
/// cap), one never capped and one the reload caps are not listed.
#[test]
fn a_reload_lists_the_caps_it_took_away() {
    let capped = |p: &str, cap| RouteSpec {
        max_in_flight: Some(cap),
        queue_timeout: Duration::from_secs(1),
        ..spec(p, 1)
    };
    let old = Router::new(
        vec![
            capped("/kept", 2),
            capped("/uncapped", 2),
            capped("/gone", 2),
            spec("/plain", 1),
            spec("/capped-now", 1),
        ],
        1,
    )
    .unwrap();
    let new = Router::new(
        vec![
            capped("/kept", 5),
            spec("/uncapped", 1),
            spec("/plain", 1),
            capped("/capped-now", 1),
        ],
        1,
    )
    .unwrap();
    let r = Reloaded::new(&old, &new);
    assert_eq!(r.uncapped, [Arc::from("/uncapped")]);
    assert_eq!(r.gone, [Arc::from("/gone")]);
    assert_eq!(r.loaded_ms(), new.default_route().loaded_ms);
}
