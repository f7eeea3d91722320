//! The access log: one line per request, written straight into a reused buffer and handed to
//! a writer thread in batches ([`sink`]).
//!
//! As a tracing event, the line cost a visitor call per field, serde_json, a formatted
//! timestamp, a `Vec` and a channel message — 27 % of the gateway's throughput at
//! `RUST_LOG=info`. Here the fields are a struct written in a fixed order, numbers go through
//! `itoa`, `zmij` (serde_json's float formatter) and `ryu` (std's digits, for the pretty
//! lines), and the date part of the timestamp is made once a second. The output is what tracing-subscriber's fmt layer wrote for the event:
//! the same JSON object (`flatten_event`), or the same compact line, colours included. Whether
//! there is an access log is still `RUST_LOG`'s to say: [`enabled`] asks tracing's filter
//! about the `tollgate::access` target.

mod sink;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::io::Write;
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use sink::{Limits, Sink};

use crate::reason::{Reason, Verdict};

/// One request's access-log line: the fields of DESIGN §5, in the order they are written.
/// `None` fields are left out of the line.
#[derive(Debug, Clone)]
pub struct AccessRecord<'a> {
    pub method: &'a str,
    pub route: &'a str,
    /// The registry id or hash prefix (`Identity::log_name`), or `-`: never the key.
    pub key: &'a str,
    pub cost: u64,
    pub decision: Verdict,
    pub status: u16,
    pub latency_ms: f64,
    pub upstream_ms: Option<f64>,
    pub store_ms: f64,
    pub queue_ms: f64,
    pub hold_ms: f64,
    pub upstream_status: Option<u16>,
    pub request_id: Option<&'a str>,
    /// The request's trace id, when tracing is on.
    pub trace_id: Option<&'a str>,
    pub fallback: bool,
    pub shadow: Option<Reason>,
    pub client: Option<IpAddr>,
    pub error: Option<&'a str>,
    /// The async job the request submitted or asked about, or that ended (DESIGN §8).
    pub job: Option<&'a str>,
}

/// The two line formats of `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// tracing-subscriber's `json().flatten_event(true)`.
    Json,
    /// tracing-subscriber's `compact()`, with or without ANSI colours.
    Compact { ansi: bool },
}

struct AccessLog {
    style: Style,
    sink: Arc<Sink>,
}

static ACCESS: OnceLock<AccessLog> = OnceLock::new();

/// At most one `write(2)` per 5 ms or per 32 KiB — at 20k requests/s, ~200 writes of ~35 KB
/// a second, a few hundredths of a core — and 8 MiB, tens of thousands of lines, before a
/// stalled stderr costs lines instead of memory. A line is at most 5 ms late, and one after a
/// quiet spell goes out at once, as through tracing's writer: some tests read the log right
/// after a response (tests/fidelity.rs).
const LIMITS: Limits = Limits {
    batch: 32 * 1024,
    delay: Duration::from_millis(5),
    max_pending: 8 * 1024 * 1024,
};

/// Starts the access log's writer thread, writing to stderr (called by `init_logging`, once
/// tracing's subscriber is in place).
pub(super) fn install(json: bool, ansi: bool) {
    let style = if json {
        Style::Json
    } else {
        Style::Compact { ansi }
    };
    let sink = Sink::new(Box::new(std::io::stderr()), LIMITS);
    match sink.spawn_writer() {
        Ok(()) => {
            let _ = ACCESS.set(AccessLog { style, sink });
        }
        Err(e) => tracing::error!(error = %e, "cannot start the access log's writer thread"),
    }
}

/// Whether to build an access-log line at all: the log is installed and `RUST_LOG` lets
/// `tollgate::access` INFO events through (the default `info` does, `warn` or
/// `tollgate::access=off` do not). Cheap: tracing caches the filter's answer per callsite.
pub fn enabled() -> bool {
    ACCESS.get().is_some() && tracing::enabled!(target: "tollgate::access", tracing::Level::INFO)
}

/// Formats `r` and queues it for the writer thread. Call only when [`enabled`].
pub fn write(r: &AccessRecord<'_>) {
    let Some(log) = ACCESS.get() else {
        return;
    };
    let now = SystemTime::now();
    // A thread whose locals are gone (or a re-entrant call) loses the line, not the request.
    let _ = SCRATCH.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            let Scratch { line, clock } = &mut *s;
            line.clear();
            r.format(log.style, clock, now, line);
            log.sink.push(line);
        }
    });
}

/// Writes out every queued line.
pub(super) fn flush() {
    if let Some(log) = ACCESS.get() {
        log.sink.flush();
    }
}

/// Each worker thread's line buffer and date cache.
struct Scratch {
    line: Vec<u8>,
    clock: Clock,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch {
        line: Vec::with_capacity(512),
        clock: Clock::default(),
    });
}

/// RFC 3339 UTC timestamps with microseconds, as tracing-subscriber's default timer writes
/// them; `YYYY-MM-DDTHH:MM:SS` is made again only when the second changes.
#[derive(Default)]
struct Clock {
    second: u64,
    prefix: [u8; 19],
}

impl Clock {
    fn write(&mut self, now: SystemTime, out: &mut Vec<u8>) {
        // Before 1970 is a broken clock: show the epoch.
        let since = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let second = since.as_secs();
        if second != self.second || self.prefix[0] == 0 {
            self.second = second;
            self.prefix = date_time(second);
        }
        out.extend_from_slice(&self.prefix);
        out.push(b'.');
        let micros = since.subsec_micros();
        let mut digits = [b'0'; 6];
        let mut n = micros;
        for d in digits.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        out.extend_from_slice(&digits);
        out.push(b'Z');
    }
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix time (UTC; the proleptic Gregorian calendar, via Howard
/// Hinnant's `civil_from_days`). Years past 9999 keep their last four digits.
fn date_time(unix: u64) -> [u8; 19] {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, year.rem_euclid(10_000) as u64);
    put(5, 2, month as u64);
    put(8, 2, day as u64);
    put(11, 2, secs / 3600);
    put(14, 2, secs / 60 % 60);
    put(17, 2, secs % 60);
    out
}

/// A field's name as each style writes it before the value, with the separator that comes
/// before every field but the first (one byte, skipped for the first): made at compile time,
/// so that a field costs one copy before its value instead of three or four.
struct Name {
    json: &'static str,
    compact: &'static str,
    ansi: &'static str,
}

macro_rules! name {
    ($n:literal) => {
        &Name {
            json: concat!(",\"", $n, "\":"),
            compact: concat!(" ", $n, "="),
            ansi: concat!(" \x1b[3m", $n, "\x1b[0m\x1b[2m=\x1b[0m"),
        }
    };
}

impl AccessRecord<'_> {
    /// Appends the line (with its newline) to `out`.
    fn format(&self, style: Style, clock: &mut Clock, now: SystemTime, out: &mut Vec<u8>) {
        match style {
            Style::Json => {
                out.extend_from_slice(b"{\"timestamp\":\"");
                clock.write(now, out);
                out.extend_from_slice(b"\",\"level\":\"INFO\",");
            }
            Style::Compact { ansi: true } => {
                out.extend_from_slice(b"\x1b[2m");
                clock.write(now, out);
                out.extend_from_slice(
                    b"\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2mtollgate::access\x1b[0m\x1b[2m:\x1b[0m ",
                );
            }
            Style::Compact { ansi: false } => {
                clock.write(now, out);
                out.extend_from_slice(b"  INFO tollgate::access: ");
            }
        }
        let mut f = Fields {
            out,
            style,
            first: true,
        };
        f.str(name!("method"), self.method);
        f.str(name!("route"), self.route);
        f.str(name!("key"), self.key);
        f.u64(name!("cost"), self.cost);
        f.str(name!("decision"), self.decision.as_str());
        f.u64(name!("status"), self.status.into());
        f.f64(name!("latency_ms"), self.latency_ms);
        if let Some(v) = self.upstream_ms {
            f.f64(name!("upstream_ms"), v);
        }
        f.f64(name!("store_ms"), self.store_ms);
        f.f64(name!("queue_ms"), self.queue_ms);
        f.f64(name!("hold_ms"), self.hold_ms);
        if let Some(v) = self.upstream_status {
            f.u64(name!("upstream_status"), v.into());
        }
        if let Some(v) = self.request_id {
            f.str(name!("request_id"), v);
        }
        if let Some(v) = self.trace_id {
            f.str(name!("trace_id"), v);
        }
        f.bool(name!("fallback"), self.fallback);
        if let Some(v) = self.shadow {
            f.str(name!("shadow"), v.as_str());
        }
        if let Some(v) = self.client {
            f.ip(name!("client"), v);
        }
        if let Some(v) = self.error {
            f.str(name!("error"), v);
        }
        if let Some(v) = self.job {
            f.str(name!("job"), v);
        }
        match style {
            Style::Json => out.extend_from_slice(b",\"target\":\"tollgate::access\"}\n"),
            Style::Compact { .. } => out.push(b'\n'),
        }
    }
}

/// Writes `name=value` pairs the way tracing's JSON visitor (`"name":value`) or its default
/// field formatter (`name=<Debug of value>`) would.
struct Fields<'o> {
    out: &'o mut Vec<u8>,
    style: Style,
    first: bool,
}

impl Fields<'_> {
    /// The separator (none before the first field) and the name, in one copy.
    fn name(&mut self, name: &Name) {
        let text = match self.style {
            Style::Json => name.json,
            Style::Compact { ansi: false } => name.compact,
            Style::Compact { ansi: true } => name.ansi,
        };
        let skip = usize::from(std::mem::replace(&mut self.first, false));
        self.out.extend_from_slice(&text.as_bytes()[skip..]);
    }

    fn str(&mut self, name: &Name, v: &str) {
        self.name(name);
        match self.style {
            Style::Json => json_str(self.out, v),
            Style::Compact { .. } => debug_str(self.out, v),
        }
    }

    fn u64(&mut self, name: &Name, v: u64) {
        self.name(name);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }

    fn f64(&mut self, name: &Name, v: f64) {
        self.name(name);
        // Durations come at microsecond precision (`millis`): written with integer arithmetic,
        // the digits both formats' float writers give them.
        if let Some(us) = whole_micros(v) {
            write_micros(self.out, us);
            return;
        }
        match self.style {
            Style::Json => json_f64(self.out, v),
            Style::Compact { .. } => debug_f64(self.out, v),
        }
    }

    fn bool(&mut self, name: &Name, v: bool) {
        self.name(name);
        self.out
            .extend_from_slice(if v { b"true" as &[u8] } else { b"false" });
    }

    /// An address, as a string: its text never needs escaping in either format.
    fn ip(&mut self, name: &Name, v: IpAddr) {
        self.name(name);
        self.out.push(b'"');
        match v {
            IpAddr::V4(v4) => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        self.out.push(b'.');
                    }
                    self.out
                        .extend_from_slice(itoa::Buffer::new().format(octet).as_bytes());
                }
            }
            // Writing to a Vec cannot fail.
            IpAddr::V6(v6) => {
                let _ = write!(self.out, "{v6}");
            }
        }
        self.out.push(b'"');
    }
}

/// A JSON string, escaped as serde_json does: `"` and `\`, the short forms `\b \f \n \r \t`,
/// other control characters as `\u00XX`; everything else (non-ASCII too) as it is.
fn json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(short);
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A JSON number as serde_json writes an `f64` (zmij's shortest form; `null` if not finite).
fn json_f64(out: &mut Vec<u8>, v: f64) {
    if v.is_finite() {
        out.extend_from_slice(zmij::Buffer::new().format_finite(v).as_bytes());
    } else {
        out.extend_from_slice(b"null");
    }
}

/// A duration in milliseconds at microsecond precision: what the access log records, and
/// what [`Fields::f64`] writes without a float formatter.
pub fn millis(d: Duration) -> f64 {
    // Below 2^53 µs (285 years) the conversion is exact.
    d.as_micros() as f64 / 1000.0
}

/// The microseconds `v` (milliseconds) is exactly, as [`millis`] makes it — a whole number of
/// µs below 10^15, so that its shortest round-trip digits are its own three decimals at most
/// (two decimal strings 0.001 apart cannot name the same `f64` below ~4.5 × 10^12).
fn whole_micros(v: f64) -> Option<u64> {
    if !(v.is_sign_positive() && v < 1e12) {
        return None;
    }
    let us = (v * 1000.0).round() as u64;
    (us as f64 / 1000.0 == v).then_some(us)
}

/// `us` µs as milliseconds, as `{:?}`, `ryu` and `zmij` write the `f64` `us / 1000`: the
/// integer part, a point, and the decimals without trailing zeros (at least one digit).
fn write_micros(out: &mut Vec<u8>, us: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(us / 1000).as_bytes());
    let frac = (us % 1000) as u16;
    let digits = [
        b'.',
        b'0' + (frac / 100) as u8,
        b'0' + (frac / 10 % 10) as u8,
        b'0' + (frac % 10) as u8,
    ];
    let len = match frac {
        _ if frac.is_multiple_of(100) => 2,
        _ if frac.is_multiple_of(10) => 3,
        _ => 4,
    };
    out.extend_from_slice(&digits[..len]);
}

/// A string as `{:?}` writes it. Printable ASCII other than `"` and `\` is written as it is;
/// anything else takes std's own escaping (rare: routes, ids and methods are plain).
fn debug_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

/// An `f64` as `{:?}` writes it. Between 1e-4 and 1e16 (and for +0) std writes the shortest
/// round-trip digits in plain notation, as ryu does — except where `v` lies exactly halfway
/// between two shortest forms, a tie the two break differently. Those values and the ones in
/// exponent notation (never seen in the log) go through std.
fn debug_f64(out: &mut Vec<u8>, v: f64) {
    let a = v.abs();
    if ((v == 0.0 && v.is_sign_positive()) || (1e-4..1e16).contains(&a)) && !may_tie(v) {
        out.extend_from_slice(ryu::Buffer::new().format_finite(v).as_bytes());
    } else {
        let _ = write!(out, "{v:?}");
    }
}

/// Whether a finite `v` below 1e16 can be a tie between two shortest decimal forms: its exact
/// decimal value has at most 18 significant digits (one more than a shortest form can have).
/// Writing `v` as `m × 2^q` with `m` odd, that value is `m × 5^-q / 10^-q`.
fn may_tie(v: f64) -> bool {
    let bits = v.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let fraction = bits & ((1 << 52) - 1);
    let (m, q) = if biased == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1 << 52), biased - 1075)
    };
    if m == 0 {
        return false;
    }
    let zeros = m.trailing_zeros();
    let (m, q) = (m >> zeros, q + zeros as i32);
    // An integer below 2^54 is its own shortest form; 5^28 alone has 20 digits.
    if !(-27..0).contains(&q) {
        return false;
    }
    5u64.checked_pow(q.unsigned_abs())
        .and_then(|p| m.checked_mul(p))
        .is_some_and(|exact| exact < 1_000_000_000_000_000_000)
}
