//! `every_error`: every error of a file, each once, at its field's path.

use crate::config::{Config, EnvOverrides};

fn errors(text: &str) -> Vec<String> {
    match Config::parse(text, &EnvOverrides::default()) {
        Ok(_) => vec![],
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

/// The paths of the errors, in the order reported.
fn paths(text: &str) -> Vec<String> {
    match Config::parse(text, &EnvOverrides::default()) {
        Ok(_) => vec![],
        Err(e) => e.0.into_iter().map(|e| e.path).collect(),
    }
}

/// The file's errors are exactly as many as `starts`, each beginning with its own.
fn errors_start(text: &str, starts: &[&str]) {
    let errs = errors(text);
    assert_eq!(errs.len(), starts.len(), "{errs:?}");
    for (e, start) in errs.iter().zip(starts) {
        assert!(e.starts_with(start), "{errs:?}");
    }
}

const BASE: &str = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n";

/// Unknown keys in a list entry and in a map of endpoints, with nothing else wrong: each
/// one is reported (and the file is refused).
#[test]
fn unknown_keys_in_lists_and_maps_are_all_reported() {
    let text = format!(
        "{BASE}  endpoints:\n    /a: {{cost: 1, colour: red}}\nplans:\n  pro:\n    budgets:\n      - {{name: m, max_cost: 5, window: 1m, size: 3}}\n"
    );
    errors_start(
        &text,
        &[
            "rate_limits.endpoints.\"/a\".colour: unknown field `colour`",
            "plans.pro.budgets[0].size: unknown field `size`",
        ],
    );
}

/// A word that is none of a field's three or more choices (serde: "expected one of `a`,
/// `b`, `c`") stands in as the first: the errors after it are reported too.
#[test]
fn an_unknown_choice_among_many_hides_no_later_error() {
    let text = format!(
        "store: {{backend: memory, on_error: maybe}}\n{BASE}  endpoints: {{/b: {{cost: 0}}}}\nbogus_top: 1\n"
    );
    let paths = paths(&text);
    for want in [
        "store.on_error",
        "bogus_top",
        "rate_limits.endpoints.\"/b\".cost",
    ] {
        assert!(paths.iter().any(|p| p == want), "{want} not in {paths:?}");
    }
}

/// An empty file, or one of comments only, is missing what `{}` is missing.
#[test]
fn an_empty_file_says_everything_that_is_missing() {
    let want = paths("{}");
    assert!(want.len() > 1, "{want:?}");
    for text in ["", "# nothing yet\n", "---\n"] {
        assert_eq!(paths(text), want, "{text:?}");
    }
}

/// After the unknown keys, a type error is reported too, and the stand-in put in its place
/// (a thousand million threads) draws no error of its own.
#[test]
fn a_type_error_after_an_unknown_key_is_reported_too() {
    let text = format!("server: {{listn: x, threads: many}}\n{BASE}");
    errors_start(
        &text,
        &[
            "server.listn: unknown field",
            "server.threads: invalid type",
        ],
    );
}

/// An endpoint given no settings (`/b: ~`) stands in as a whole: the endpoints beside it
/// are still checked (before, every endpoint's errors were masked with it).
#[test]
fn an_endpoint_without_settings_does_not_hide_its_siblings() {
    let text = format!("{BASE}  endpoints:\n    /b: ~\n    /c: {{cost: 0}}\n");
    assert_eq!(
        paths(&text),
        [
            "rate_limits.endpoints.\"/b\"",
            "rate_limits.endpoints.\"/c\".cost"
        ]
    );
}

/// Two endpoints given no settings are both reported: the tree is parsed as the text is
/// (serde_yaml's tree reads a null as an empty map, so the second once passed unseen).
#[test]
fn every_endpoint_without_settings_is_reported() {
    let text = format!("{BASE}  endpoints:\n    /a: ~\n    /b: ~\n    /c:\n    /d: {{cost: 0}}\n");
    assert_eq!(
        paths(&text),
        [
            "rate_limits.endpoints.\"/a\"",
            "rate_limits.endpoints.\"/b\"",
            "rate_limits.endpoints.\"/c\"",
            "rate_limits.endpoints.\"/d\".cost"
        ]
    );
    let errs = errors(&text);
    assert!(
        errs[1].ends_with("no value given, expected an endpoint's settings, a map like {cost: 20}"),
        "{errs:?}"
    );
}

/// DESIGN §1: every error, with its path. A duration without a unit (a type error that
/// stopped the typed parse) no longer hides the rules checked after it.
#[test]
fn a_type_error_does_not_hide_the_other_errors() {
    let text = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60, max_cost: 120}\n  endpoints:\n    /reports/generate: {cost: 0}\n    /b//c: {cost: 2}\n    /d: {cost: x}\n";
    assert_eq!(
        paths(text),
        [
            "rate_limits.default.window",
            "rate_limits.endpoints.\"/d\".cost",
            "rate_limits.endpoints.\"/b//c\"",
            "rate_limits.endpoints.\"/reports/generate\".cost",
        ]
    );
}

/// Every repeated key is reported, and the first of each is still checked: here its cost
/// is not a number.
#[test]
fn every_repeated_key_is_reported_and_the_rest_checked() {
    let text = format!(
        "{BASE}  endpoints:\n    /a: {{cost: 0}}\n    /b: {{cost: x}}\n    /b: {{cost: 2}}\nplans:\n  p1: {{max_cost: 5, window: 1m}}\n  p1: {{max_cost: 6, window: 1m}}\nupstreams:\n  u: {{url: \"http://127.0.0.1:1\"}}\n  u: {{url: \"http://127.0.0.1:2\"}}\n"
    );
    let errs = errors(&text);
    let paths: Vec<&str> = errs.iter().map(|e| e.split(": ").next().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "rate_limits.endpoints.\"/b\"",
            "plans.p1",
            "upstreams.u",
            "rate_limits.endpoints.\"/b\".cost",
            "rate_limits.endpoints.\"/a\".cost",
        ],
        "{errs:?}"
    );
    assert!(errs[0].contains("appears twice"), "{errs:?}");
}

/// A field repeated in a section (serde names it at the section) is one error, at the
/// field's own path, with its line where serde gives one; before, it was reported twice,
/// once at the section (`.` for the top level).
#[test]
fn a_repeated_field_is_one_error_at_its_path() {
    let text = format!("{BASE}upstream: {{url: \"http://127.0.0.1:3001\"}}\n");
    assert_eq!(
        errors(&text),
        ["upstream: appears twice in this map; each key may appear only once"]
    );
    let text = BASE.replace("max_cost: 120}", "max_cost: 120, cost: 2}");
    assert_eq!(
        errors(&text),
        ["rate_limits.default.cost: appears twice in this map; each key may appear only once at line 3 column 12"]
    );
}

/// A word that is none of a field's choices gets the first choice as its stand-in, so
/// the parse goes on to the next mistake (a size below zero) and to validation (a budget
/// wrong in both of its limits).
#[test]
fn an_unknown_choice_and_a_bad_size_are_both_reported() {
    let text = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 0s, max_cost: 0}\n  endpoints:\n    /x: {cost: 5, max_in_flight: 2, async: {when: sometimes, max_response_body: -1}}\n";
    let errs = errors(text);
    assert_eq!(errs.len(), 4, "{errs:?}");
    assert!(
        errs[0].starts_with("rate_limits.endpoints.\"/x\".async.when: unknown variant `sometimes`"),
        "{errs:?}"
    );
    assert_eq!(
        errs[1],
        "rate_limits.endpoints.\"/x\".async.max_response_body: invalid type: integer `-1`, expected a size like 512KiB, 1MiB or 16MiB, or a number of bytes"
    );
    assert_eq!(
        errs[2],
        "rate_limits.default.max_cost: must be a positive integer, got 0"
    );
    assert_eq!(
        errs[3],
        "rate_limits.default.window: must be greater than 0"
    );
}

/// A missing field is reported once: the stand-in put in its place lets the rest of the
/// file be checked, and what validation would say of the stand-in is not shown.
#[test]
fn a_missing_field_is_reported_once() {
    let text = "upstream: {connect_timeout: 2s}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n  endpoints:\n    /a: {cost: 0}\n";
    errors_start(
        text,
        &[
            "upstream: missing field `url`",
            "rate_limits.endpoints.\"/a\".cost",
        ],
    );
}

/// A missing section is one error: the empty map standing in for it lacks its fields, but
/// that is not the file's mistake. Nor is it when a section of the wrong type stands in.
#[test]
fn what_a_stand_in_lacks_is_not_reported() {
    errors_start(
        "upstream: {url: \"http://127.0.0.1:3000\"}\n",
        &[".: missing field `rate_limits`"],
    );
    errors_start(
        "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits: 5\n",
        &["rate_limits: invalid type"],
    );
    assert_eq!(paths(""), vec![".", "."]);
}

/// A file of many unknown keys is not parsed once per key without end.
#[test]
fn unknown_keys_are_reported_up_to_a_bound() {
    let keys: String = (0..500).map(|i| format!("  k{i}: 1\n")).collect();
    let errs = errors(&format!("server:\n{keys}{BASE}"));
    assert_eq!(errs.len(), super::MAX_REPORTED_ERRORS, "{}", errs.len());
}

/// Nor one of many type errors: each mends with at most a few parses, and the whole
/// is bounded.
#[test]
fn type_errors_are_reported_up_to_a_bound() {
    let eps: String = (0..300)
        .map(|i| format!("    /e{i}: {{cost: [1]}}\n"))
        .collect();
    let errs = errors(&format!("{BASE}  endpoints:\n{eps}"));
    assert!(
        errs.len() >= 10 && errs.len() <= super::MAX_REPORTED_ERRORS,
        "{}",
        errs.len()
    );
}
