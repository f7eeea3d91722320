//! A job's record as the fleet keeps it (`t:j:<id>`, `store/lua/jobs.lua`): its fields, the
//! request and response headers in it (JSON of name and base64 value), and who pays for it.

use std::collections::HashMap;
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use pingora::http::RequestHeader;

use super::super::metrics::JobResult;
use super::super::send::JobRequest;
use crate::identity::Identity;
use crate::route::Route;
use crate::state::Running;
use crate::store::redis::RedisBackend;
use crate::telemetry::access;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub(super) fn headers_json(h: &http::HeaderMap) -> Vec<u8> {
    let list: Vec<[String; 2]> = h
        .iter()
        .map(|(n, v)| [n.as_str().to_string(), B64.encode(v.as_bytes())])
        .collect();
    serde_json::to_vec(&list).unwrap_or_default()
}

pub(super) fn headers_from(json: &[u8]) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let list: Vec<[String; 2]> = serde_json::from_slice(json).unwrap_or_default();
    list.into_iter()
        .filter_map(|[n, v]| {
            let name = http::HeaderName::from_bytes(n.as_bytes()).ok()?;
            let value = http::HeaderValue::from_bytes(&B64.decode(v).ok()?).ok()?;
            Some((name, value))
        })
        .collect()
}

pub(super) type Record = HashMap<String, Vec<u8>>;

pub(super) fn field<'a>(r: &'a Record, name: &str) -> &'a [u8] {
    r.get(name).map_or(&[], |v| v.as_slice())
}

pub(super) fn text(r: &Record, name: &str) -> String {
    String::from_utf8_lossy(field(r, name)).into_owned()
}

/// The record of job `id`: `Ok(None)` when Redis has none (unknown, expired, or lost with
/// Redis's data), an error when Redis did not answer. A running job whose runner's word for
/// it lapsed is declared lost (`failed`, `uncounted`) when this instance may tell
/// (`RedisBackend::may_find_jobs_lost`: not just after Redis was silent), else read as
/// running.
pub(super) async fn read(
    b: &RedisBackend,
    id: &str,
) -> Result<Option<Record>, crate::store::StoreError> {
    let r = parse(b.job_record(id, "get", &[]).await?);
    match r {
        // Its runner may renew it meanwhile: `lose` decides again.
        Some(r) if lapsed(&r).is_some_and(|ago| b.may_find_jobs_lost(ago)) => {
            Ok(parse(b.job_record(id, "lose", &[]).await?))
        }
        r => Ok(r),
    }
}

/// The record of a job its caller's claim expired, also once it reads as gone (its
/// `result_ttl` over: the claim's answer came late): what it was charged, to refund.
pub(super) async fn read_expired(
    b: &RedisBackend,
    id: &str,
) -> Result<Option<Record>, crate::store::StoreError> {
    let args: [&[u8]; 1] = [b"kept"];
    Ok(parse(b.job_record(id, "get", &args).await?))
}

/// How long (by Redis's clock) reads have found the running job's runner's word for it
/// lapsed, if they have (`lua/jobs.lua` `get`).
fn lapsed(r: &Record) -> Option<std::time::Duration> {
    let ms = std::str::from_utf8(r.get("lapsed")?).ok()?.parse().ok()?;
    Some(std::time::Duration::from_millis(ms))
}

/// A record from its fields and values; `None` when there are none.
fn parse(flat: Vec<Vec<u8>>) -> Option<Record> {
    let mut r = Record::new();
    let mut pairs = flat.into_iter();
    while let (Some(k), Some(v)) = (pairs.next(), pairs.next()) {
        r.insert(String::from_utf8_lossy(&k).into_owned(), v);
    }
    (!r.is_empty()).then_some(r)
}

/// Whether the record is of a job found lost whose end nobody has counted yet.
pub(super) fn uncounted(r: &Record) -> bool {
    field(r, "uncounted") == b"1"
}

/// Counts and logs the end of job `id`, found lost, if this call is the one that takes it
/// (`lua/jobs.lua` `count`): its reader, or a later one should that reader's answer have been
/// lost, or its runner when its result is refused. A call Redis does not answer leaves it to
/// the next.
pub(super) async fn count_lost(running: &Running, b: &RedisBackend, id: &str) {
    if let Ok(flat) = b.job_record::<Vec<Vec<u8>>>(id, "count", &[]).await {
        if let Some(r) = parse(flat) {
            ended_unrun(running, &r, id, JobResult::Failed);
        }
    }
}

/// When a claim, or a claimed job's read, that went unanswered is sent again (doubling up to
/// [`CLAIM_AGAIN_AT_MOST`]).
const CLAIM_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_millis(100);
const CLAIM_AGAIN_AT_MOST: std::time::Duration = std::time::Duration::from_millis(500);

/// Sends `call`, a record operation whose first try Redis did not answer and whose resend
/// is the same as it (a claim with its token, a read), again after [`CLAIM_AGAIN_AFTER`],
/// doubling, while Redis does not answer and until `give_up`: its answer, or the last error.
pub(super) async fn sent_again<T, F, Fut>(
    give_up: tokio::time::Instant,
    mut call: F,
) -> Result<T, crate::store::StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, crate::store::StoreError>>,
{
    let mut again = CLAIM_AGAIN_AFTER;
    loop {
        tokio::time::sleep(again).await;
        again = (again * 2).min(CLAIM_AGAIN_AT_MOST);
        match call().await {
            Err(_) if tokio::time::Instant::now() + again < give_up => {}
            answered => return answered,
        }
    }
}

/// A claimed job's record, route, payer and request; `None` when one is gone (the record
/// expired or was lost, a reload removed the route, the key is no longer known), or Redis
/// did not answer the read, sent again, until `give_up` (the claim made the job this
/// instance's: giving up leaves it to be found lost, never sent).
pub(super) async fn claimed(
    b: &RedisBackend,
    running: &Running,
    id: &str,
    label: &str,
    give_up: tokio::time::Instant,
) -> Option<(Record, Arc<Route>, Identity, JobRequest)> {
    let answered = match read(b, id).await {
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::debug!(job = id, error = %e, "a claimed job's record went unread: read again");
            sent_again(give_up, || read(b, id)).await
        }
    };
    let r = match answered {
        Ok(r) => r?,
        Err(e) => {
            tracing::warn!(job = id, error = %e, "a claimed job's record could not be read; its slot is given up");
            return None;
        }
    };
    let route = running.config.router.by_label(label)?.clone();
    let who = payer(running, field(&r, "key"))?;
    let request = request_of(&r)?;
    Some((r, route, who, request))
}

/// A job that ended with no runner to say so — cancelled, expired in its queue, or lost with
/// its runner — as whichever instance saw it end counts it: `tollgate_jobs_total` and the
/// job's last access-log line (status and charge as the memory store's: cancelled 499 and 0,
/// expired 503 and 0, lost 502 and its charge).
pub(super) fn ended_unrun(running: &Running, r: &Record, id: &str, result: JobResult) {
    let route = text(r, "route");
    super::metrics::ended(&route, result);
    if !access::enabled() {
        return;
    }
    let who = payer(running, field(r, "key"));
    let (status, cost) = match result {
        JobResult::Expired => (503, 0),
        // Nobody is answered: its client called it off (as for a client that left, 499).
        JobResult::Cancelled => (499, 0),
        // As charged; a record of an older instance, as its route costs now.
        _ => (
            502,
            super::charged::cost_of(r)
                .or_else(|| running.config.router.by_label(&route).map(|r| r.cost))
                .unwrap_or(0),
        ),
    };
    let (waited, held, queued) = wait_of(r);
    // Never run: it was held, then waited, all along (a lost run's wait is not known).
    let (held, queued) = match result {
        JobResult::Failed => (0.0, 0.0),
        _ => (access::millis(held), access::millis(queued)),
    };
    let key = who.map_or_else(|| "-".to_string(), |w| w.log_name().to_string());
    let rid = text(r, "rid");
    let traced = running.config.tracing.is_some();
    let trace = headers_from(field(r, "headers"))
        .into_iter()
        .find(|(name, _)| traced && name == "traceparent")
        .and_then(|(_, v)| crate::trace::TraceHex::of_traceparent(v.as_bytes()));
    access::write(&access::AccessRecord {
        method: &text(r, "method"),
        route: &route,
        key: &key,
        cost,
        decision: result.verdict(),
        status,
        latency_ms: access::millis(waited),
        upstream_ms: None,
        store_ms: 0.0,
        queue_ms: queued,
        hold_ms: held,
        upstream_status: None,
        request_id: (!rid.is_empty()).then_some(rid.as_str()),
        trace_id: trace.as_ref().map(|t| t.as_str()),
        fallback: false,
        shadow: None,
        client: client_of(r),
        error: None,
        job: Some(id),
    });
}

/// The address of the client that submitted the job (none in a record written before it was
/// kept).
pub(super) fn client_of(r: &Record) -> Option<std::net::IpAddr> {
    text(r, "ip").parse().ok()
}

/// How long ago the job was submitted (`sub`, Redis's clock in ms, against this instance's).
pub(super) fn waited(r: &Record) -> std::time::Duration {
    let now_ms = crate::unix_ms();
    let sub = std::str::from_utf8(field(r, "sub"))
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(now_ms);
    std::time::Duration::from_millis(now_ms.saturating_sub(sub))
}

/// A record's job's wait from its submission to now: all of it, the part it was held for its
/// `max_delay` turn (the queue served it no sooner), and the rest, queued.
pub(super) fn wait_of(
    r: &Record,
) -> (
    std::time::Duration,
    std::time::Duration,
    std::time::Duration,
) {
    let waited = waited(r);
    let held = delay(r).min(waited);
    (waited, held, waited - held)
}

/// Whether a queued job had waited `result_ttl` when its record was read (to expire).
pub(super) fn overdue(r: &Record) -> bool {
    field(r, "state") == b"queued" && field(r, "overdue") == b"1"
}

/// How long after its submission a record's job was not to be sent (`max_delay`'s hold).
pub(super) fn delay(r: &Record) -> std::time::Duration {
    let ms = std::str::from_utf8(field(r, "delay"))
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0);
    std::time::Duration::from_millis(ms)
}

/// The identity a record's key hash pays as: its registry entry, else the default policy.
pub(super) fn payer(running: &Running, key_hex: &[u8]) -> Option<Identity> {
    let mut hash = [0u8; 32];
    hex::decode_to_slice(key_hex, &mut hash).ok()?;
    let cfg = &running.config;
    Some(match cfg.keys.get(&hash) {
        Some(e) => Identity {
            hash,
            id: Some(e.id.clone()),
            policy: e.policy.clone(),
        },
        None => Identity {
            hash,
            id: None,
            policy: cfg.default_policy.clone(),
        },
    })
}

pub(super) fn request_of(r: &Record) -> Option<JobRequest> {
    let mut header =
        RequestHeader::build(text(r, "method").as_str(), field(r, "target"), None).ok()?;
    for (n, v) in headers_from(field(r, "headers")) {
        header.append_header(n, v).ok()?;
    }
    Some(JobRequest {
        header,
        body: Bytes::copy_from_slice(field(r, "body")),
    })
}

/// Writes a new job's record (`queued`); `false` when Redis did not take it.
pub(super) async fn put(
    b: &RedisBackend,
    id: &str,
    (route, admit): (&str, &crate::store::AdmitRequest),
    who: &Identity,
    (result_ttl, hold): (std::time::Duration, std::time::Duration),
    request: &JobRequest,
    origin: &crate::jobs::run::Origin,
) -> bool {
    let rid = origin.request_id.as_deref().unwrap_or_default();
    let ttl_ms = (result_ttl.as_millis() as u64).to_string();
    // `max_delay`: it is sent no sooner than this after the record is written (whole ms).
    let delay_ms = (hold.as_micros() as u64).div_ceil(1000);
    // The record lives while the job is held and may wait (result_ttl) and then be kept
    // (result_ttl).
    let life = ((result_ttl.as_millis() as u64) * 2 + delay_ms + 60_000).to_string();
    let delay_ms = delay_ms.to_string();
    let key = hex::encode(who.hash);
    let headers = headers_json(&request.header.headers);
    let ip = origin.client.map(|c| c.to_string()).unwrap_or_default();
    let charged = super::charged::of(admit);
    let args: [&[u8]; 27] = [
        life.as_bytes(),
        b"key",
        key.as_bytes(),
        b"route",
        route.as_bytes(),
        b"state",
        b"queued",
        b"ttl",
        ttl_ms.as_bytes(),
        b"method",
        request.header.method.as_str().as_bytes(),
        b"target",
        request.header.raw_path(),
        b"headers",
        &headers,
        b"body",
        &request.body,
        b"rid",
        rid.as_bytes(),
        b"ip",
        ip.as_bytes(),
        b"pos",
        b"0",
        b"chg",
        &charged,
        b"delay",
        delay_ms.as_bytes(),
    ];
    b.job_record::<i64>(id, "put", &args).await.is_ok()
}
