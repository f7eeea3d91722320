//! The line must be what tracing-subscriber's fmt layer wrote for the old
//! `tracing::info!(target: "tollgate::access", …)` event: each test formats a record both
//! ways and compares the bytes.

use super::*;

use std::sync::Mutex;
use std::time::UNIX_EPOCH;

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// 2023-11-14T22:13:20.012345Z
fn at() -> SystemTime {
    UNIX_EPOCH + Duration::new(1_700_000_000, 12_345_678)
}
const AT: &str = "2023-11-14T22:13:20.012345Z";

/// tracing's timer, showing what our clock shows.
struct Fixed;

impl FormatTime for Fixed {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        w.write_str(AT)
    }
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The event as `Gateway::logging` emitted it before (same fields, same order, same types).
fn emit(r: &AccessRecord<'_>) {
    tracing::info!(
        target: "tollgate::access",
        method = r.method,
        route = r.route,
        key = r.key,
        cost = r.cost,
        decision = r.decision.as_str(),
        status = r.status,
        latency_ms = r.latency_ms,
        upstream_ms = r.upstream_ms,
        store_ms = r.store_ms,
        queue_ms = r.queue_ms,
        hold_ms = r.hold_ms,
        upstream_status = r.upstream_status,
        request_id = r.request_id,
        trace_id = r.trace_id,
        fallback = r.fallback,
        shadow = r.shadow.map(Reason::as_str),
        client = r.client.map(|c| c.to_string()).as_deref(),
        error = r.error,
    );
}

/// What tracing-subscriber, set up as `init_logging` sets it up, writes for the event.
fn by_tracing(style: Style, r: &AccessRecord<'_>) -> String {
    let cap = Capture::default();
    let out = cap.clone();
    let builder = tracing_subscriber::fmt()
        .with_writer(move || out.clone())
        .with_timer(Fixed);
    match style {
        Style::Json => {
            tracing::subscriber::with_default(builder.json().flatten_event(true).finish(), || {
                emit(r)
            })
        }
        Style::Compact { ansi } => {
            tracing::subscriber::with_default(builder.with_ansi(ansi).compact().finish(), || {
                emit(r)
            })
        }
    }
    let bytes = cap.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

fn by_us(style: Style, r: &AccessRecord<'_>) -> String {
    let mut out = Vec::new();
    r.format(style, &mut Clock::default(), at(), &mut out);
    String::from_utf8(out).unwrap()
}

fn plain() -> AccessRecord<'static> {
    AccessRecord {
        method: "GET",
        route: "/v1/search",
        key: "acme-prod",
        cost: 5,
        decision: Verdict::Admitted,
        status: 200,
        latency_ms: 1.234567,
        upstream_ms: Some(0.987),
        store_ms: 0.012,
        queue_ms: 0.0,
        hold_ms: 0.0,
        upstream_status: Some(200),
        request_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
        trace_id: Some("0af7651916cd43dd8448eb211c80319c"),
        fallback: false,
        shadow: None,
        client: Some("127.0.0.1".parse().unwrap()),
        error: None,
        job: None,
    }
}

/// Every optional field absent, numbers at their edges.
fn sparse() -> AccessRecord<'static> {
    AccessRecord {
        method: "delete",
        route: "default",
        key: "-",
        cost: u64::MAX,
        decision: Verdict::Refused(Reason::BadPath),
        status: 0,
        latency_ms: 0.00001234,
        upstream_ms: None,
        store_ms: 1e20,
        queue_ms: 3.0,
        hold_ms: 12345.0,
        upstream_status: None,
        request_id: None,
        trace_id: None,
        fallback: true,
        shadow: None,
        client: None,
        error: None,
        job: None,
    }
}

/// Strings that need escaping, an IPv6 client, the error and shadow fields.
fn awkward() -> AccessRecord<'static> {
    AccessRecord {
        method: "GET",
        route: "/v1/\"quoted\"/back\\slash",
        key: "key:ba7816bf",
        cost: 0,
        decision: Verdict::Shadow,
        status: 502,
        latency_ms: 30000.5,
        upstream_ms: Some(29999.25),
        store_ms: 0.0001,
        queue_ms: 0.5,
        hold_ms: 250.0,
        upstream_status: None,
        request_id: Some("tab\there\nnl\r\u{0}\u{1b}[31m\u{7f} é 日本 \u{2028} 🦀 \u{301}'"),
        trace_id: None,
        fallback: false,
        shadow: Some(Reason::Budget),
        client: Some("2001:db8::1".parse().unwrap()),
        error: Some("ConnectRefused"),
        job: None,
    }
}

#[test]
fn json_lines_are_the_ones_tracing_wrote() {
    for r in [plain(), sparse(), awkward()] {
        let ours = by_us(Style::Json, &r);
        assert_eq!(ours, by_tracing(Style::Json, &r));
        // And a JSON object whose keys are the old ones.
        let v: serde_json::Value = serde_json::from_str(&ours).unwrap();
        assert_eq!(v["target"], "tollgate::access");
        assert_eq!(v["timestamp"], AT);
        assert_eq!(v["level"], "INFO");
    }
    let v: serde_json::Value = serde_json::from_str(&by_us(Style::Json, &plain())).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    let mut expected = vec![
        "timestamp",
        "level",
        "method",
        "route",
        "key",
        "cost",
        "decision",
        "status",
        "latency_ms",
        "upstream_ms",
        "store_ms",
        "queue_ms",
        "hold_ms",
        "upstream_status",
        "request_id",
        "trace_id",
        "fallback",
        "client",
        "target",
    ];
    expected.sort();
    assert_eq!(keys, expected); // serde_json's map is sorted
    assert!(v["queue_ms"].is_f64(), "floats stay floats: {v}");
    assert_eq!(v["status"], 200);
}

#[test]
fn compact_lines_are_the_ones_tracing_wrote() {
    for ansi in [false, true] {
        for r in [plain(), sparse(), awkward()] {
            assert_eq!(
                by_us(Style::Compact { ansi }, &r),
                by_tracing(Style::Compact { ansi }, &r)
            );
        }
    }
    assert_eq!(
        by_us(Style::Compact { ansi: false }, &plain()),
        format!(
            "{AT}  INFO tollgate::access: method=\"GET\" route=\"/v1/search\" key=\"acme-prod\" \
             cost=5 decision=\"admitted\" status=200 latency_ms=1.234567 upstream_ms=0.987 \
             store_ms=0.012 queue_ms=0.0 hold_ms=0.0 upstream_status=200 \
             request_id=\"4bf92f3577b34da6a3ce929d0e0e4736\" \
             trace_id=\"0af7651916cd43dd8448eb211c80319c\" fallback=false client=\"127.0.0.1\"\n"
        )
    );
}

#[test]
fn json_strings_are_escaped_as_serde_json_escapes_them() {
    let mut all_ascii = String::new();
    for b in 0u8..0x80 {
        all_ascii.push(char::from(b));
    }
    for s in [
        "",
        "plain",
        "\"quotes\" and \\backslashes\\",
        "\u{8}\u{c}\n\r\t\u{0}\u{1f}\u{7f}",
        "é 日本 \u{2028}\u{2029} 🦀 \u{fffd}",
        &all_ascii,
    ] {
        let mut out = Vec::new();
        json_str(&mut out, s);
        let ours = String::from_utf8(out).unwrap();
        assert_eq!(ours, serde_json::to_string(s).unwrap());
        assert_eq!(serde_json::from_str::<String>(&ours).unwrap(), s);
    }
}

#[test]
fn strings_and_floats_are_written_as_debug_writes_them() {
    for s in [
        "GET",
        "a\"b",
        "back\\slash",
        "\u{1b}[0m",
        "é",
        "\u{301}",
        "'",
        "~ !",
    ] {
        let mut out = Vec::new();
        debug_str(&mut out, s);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{s:?}"));
    }
    // Edges of both notations, and a spread of values like the log's milliseconds.
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1e-4,
        9.99e-5,
        1e-5,
        1e14,
        99999999999999.98,
        1e15,
        9.999e15,
        1e16,
        1e17,
        0.1,
        0.3,
        1e300,
        5e-324,
        -1_149_636_667_324_797.2,
        -93_806_479_483_887.13,
        1.125,
    ];
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..100_000 {
        // xorshift: arbitrary bit patterns, kept to finite values.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = f64::from_bits(x);
        if v.is_finite() {
            values.push(v);
        }
        values.push((x % 10_000_000) as f64 / 1e6);
        values.push(Duration::from_nanos(x % 100_000_000_000).as_secs_f64() * 1e3);
        // Where ryu and std break ties differently (see debug_f64): few fractional bits.
        values.push(f64::from_bits(
            0x42f0_0000_0000_0000 | (x & 0x000f_ffff_ffff_ffff),
        ));
        values.push((x % (1 << 40)) as f64 / f64::from(1 << (x % 24) as u32));
    }
    // Ties (and, conservatively, any short exact value such as 1.125) take std's path;
    // everyday milliseconds take ryu's.
    assert!(may_tie(-1_149_636_667_324_797.2) && may_tie(-93_806_479_483_887.13));
    assert!(!may_tie(1.234567) && !may_tie(0.0) && !may_tie(250.0));
    for v in values {
        let mut out = Vec::new();
        debug_f64(&mut out, v);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{v:?}"));
        let mut out = Vec::new();
        json_f64(&mut out, v);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(&v).unwrap()
        );
    }
}

#[test]
fn timestamps_are_rfc3339_utc_with_microseconds() {
    let cases = [
        (0, 0, "1970-01-01T00:00:00.000000Z"),
        (951_782_400, 999_999_999, "2000-02-29T00:00:00.999999Z"),
        (1_709_164_799, 1_000, "2024-02-28T23:59:59.000001Z"),
        (1_709_164_800, 0, "2024-02-29T00:00:00.000000Z"),
        (4_107_542_400, 0, "2100-03-01T00:00:00.000000Z"),
        (1_700_000_000, 12_345_678, AT),
        (253_402_300_799, 0, "9999-12-31T23:59:59.000000Z"),
    ];
    let mut clock = Clock::default();
    for (secs, nanos, text) in cases {
        let mut out = Vec::new();
        clock.write(UNIX_EPOCH + Duration::new(secs, nanos), &mut out);
        assert_eq!(String::from_utf8(out).unwrap(), text);
    }
    // The cached second is reused, the fraction is not.
    let mut out = Vec::new();
    clock.write(UNIX_EPOCH + Duration::new(253_402_300_799, 5_000), &mut out);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "9999-12-31T23:59:59.000005Z"
    );
}

/// The integer path for durations writes what the float writers write — `{:?}` and `ryu`
/// (compact), `zmij` (JSON) — for every microsecond below 2 s, a spread of larger ones up to
/// 10^15 µs, and values that are not whole microseconds (which take the float writers).
#[test]
fn whole_microseconds_are_written_as_the_float_writers_write_them() {
    let check = |us: u64| {
        let v = millis(Duration::from_micros(us));
        assert_eq!(whole_micros(v), Some(us), "{us} µs");
        let mut ours = Vec::new();
        write_micros(&mut ours, us);
        let ours = String::from_utf8(ours).unwrap();
        assert_eq!(ours, format!("{v:?}"), "{us} µs");
        assert_eq!(ours, ryu::Buffer::new().format_finite(v), "{us} µs");
        assert_eq!(ours, zmij::Buffer::new().format_finite(v), "{us} µs");
    };
    for us in 0..2_000_000 {
        check(us);
    }
    let mut us = 2_000_000u64;
    while us < 1_000_000_000_000_000 {
        check(us);
        check(us + 1);
        check(us + 999);
        us = us * 3 + 7;
    }
    for v in [
        0.00001234,
        0.0005,
        1.0000001,
        1e12,
        2e15,
        -0.0,
        -1.0,
        f64::NAN,
    ] {
        let us = whole_micros(v);
        assert!(
            us.is_none_or(|us| us as f64 / 1000.0 == v && v >= 0.0),
            "{v}"
        );
    }
    assert_eq!(whole_micros(-0.0), None);
    assert_eq!(whole_micros(0.0005), None);
}
