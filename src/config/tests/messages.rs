//! The text of every refusal a parser makes, whole: `tollgate check` output is contract, so a
//! change of wording (or of a quoted value) shows here.

use super::*;

const DEFAULT: &str = "  default:\n    cost: 1\n    window: 60s\n    max_cost: 120\n";

fn upstream(url: &str) -> String {
    format!("upstream:\n  url: \"{url}\"\nrate_limits:\n{DEFAULT}")
}

fn window(w: &str) -> String {
    format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n  default:\n    cost: 1\n    window: \"{w}\"\n    max_cost: 120\n")
}

fn endpoint(pattern: &str) -> String {
    format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n{DEFAULT}  endpoints:\n    \"{pattern}\":\n      cost: 1\n")
}

fn request_body(size: &str) -> String {
    format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n{DEFAULT}  endpoints:\n    /r:\n      cost: 1\n      max_in_flight: 1\n      async:\n        max_request_body: \"{size}\"\n")
}

fn top(section: &str) -> String {
    format!("{section}\nupstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n{DEFAULT}")
}

fn errors(yaml: &str) -> Vec<String> {
    match parse(yaml) {
        Ok(_) => vec![],
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

/// Each case's name and its file's errors, one a line.
fn cases() -> Vec<(String, String)> {
    let mut files = vec![];
    for u in [
        "http://user:pw@host",
        "ftp://x",
        "http://host/path",
        "http://[::1",
        "http://[::1]x",
        "http://host:99999",
        "http://:80",
    ] {
        files.push((format!("upstream {u}"), upstream(u)));
    }
    for w in ["10", "x", "1d", "99999999999999h", "1.5s"] {
        files.push((format!("window {w}"), window(w)));
    }
    for s in [
        "1MB",
        "MiB",
        "99999999999999999999GiB",
        "18446744073709551615GiB",
    ] {
        files.push((format!("size {s}"), request_body(s)));
    }
    files.push((
        "cap 0 with a queue".into(),
        format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n{DEFAULT}  endpoints:\n    /r: {{cost: 1, max_in_flight: 0, queue_timeout: 1s, max_queue: 3}}\n"),
    ));
    files.push((
        "limit".into(),
        "upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n  default:\n    cost: 1\n    window: 24h\n    max_cost: 999999937\n".into(),
    ));
    for p in [
        "reports",
        "/a//b",
        "/a/./b",
        "/a%2fb",
        "/a%00b",
        "CONNECT /x",
        "/a b",
        "/a?b",
        "/a#b",
        "/a<b",
        "/a;x=1",
        "/a/%7Ex",
        "GET /a/%7E{id}",
        "/_tollgate/jobs/x",
        "POST /_tollgate/jobs/{id}",
        "/_Tollgate/Jobs/{id}/result",
        "/_tollgate/jobs",
    ] {
        files.push((format!("endpoint {p}"), endpoint(p)));
    }
    files.push((
        "endpoint without settings".into(),
        format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n{DEFAULT}  endpoints:\n    /b: ~\n"),
    ));
    for t in [
        "nope",
        "https://h:4318",
        "ftp://h:4318",
        "http://u:p@h:4318",
        "http://h:4318?x=1",
        "http://h:4318#f",
    ] {
        files.push((
            format!("tracing {t}"),
            top(&format!("tracing:\n  otlp_endpoint: \"{t}\"")),
        ));
    }
    for h in [
        "bad header",
        "x-api-key",
        "authorization",
        "host",
        "content-length",
        "X_Request_Id",
        "x-forwarded-for",
    ] {
        files.push((
            format!("key_id_header {h}"),
            top(&format!("identity:\n  key_id_header: \"{h}\"")),
        ));
    }
    for h in ["X_Request_Id", "x-forwarded-host", "host", "content-length"] {
        files.push((
            format!("sources header:{h}"),
            top(&format!(
                "identity:\n  sources: [\"bearer\", \"header:{h}\"]"
            )),
        ));
    }
    for u in [
        "foo://x",
        "redis://127.0.0.1:6379/abc",
        "redis://[::1",
        "redis://:99999",
        "redis://127.0.0.1:0",
        "redis://127.0.0.1:6379/-1",
        "redis://",
        "redis+cluster://h1?x",
        "rediss+sentinel://h1#x",
        "redis+cluster://,h2",
        "redis+cluster://h1/3",
        "redis+sentinel://h1",
        "rediss+sentinel://h1/bad*name",
        "redis+cluster://h1:0",
        "redis+sentinel://:pw@h1/m/abc",
        "redis://127.0.0.1:6379/0?password=QueryPw1&db=2",
        "rediss://h1/0#x",
    ] {
        files.push((
            format!("store {u}"),
            top(&format!("store:\n  backend: redis\n  url: \"{u}\"")),
        ));
    }
    files
        .into_iter()
        .map(|(name, yaml)| (name, errors(&yaml).join("\n")))
        .collect()
}

/// `messages.txt` holds what the parsers said when they returned their text as a `String`:
/// the typed errors must say the same, byte for byte.
#[test]
fn refusals_say_what_they_said() {
    let mut said = String::new();
    for (name, text) in cases() {
        said.push_str(&format!("== {name}\n{text}\n"));
    }
    let expected = include_str!("messages.txt");
    for (got, want) in said.lines().zip(expected.lines()) {
        assert_eq!(got, want);
    }
    assert_eq!(said, expected);
}
