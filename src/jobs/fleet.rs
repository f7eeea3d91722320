//! Jobs on a Redis fleet (one node or Sentinel; DESIGN §8): the record in Redis
//! (`store/lua/jobs.lua`), the waiter the fleet's (`store/redis/jobs.rs`), so that a queued
//! job outlives the instance that accepted it and any instance with the route runs it. A job
//! runs at most once: a grant goes to one beat, and a record is claimed `queued → running`
//! once; a runner that stops vouching for its job (it died) leaves it `failed` (`job-lost`,
//! charged) at the next read, and its slot comes back with its lapsed lease.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use pingora::http::RequestHeader;

use super::metrics::{self, InState};
use super::run::{problem_result, Origin, Submission};
use super::send::{self, JobRequest, Sent};
use super::{new_id, Stored, View};
use crate::decision;
use crate::identity::{Identity, KeyHash};
use crate::problem::Problem;
use crate::route::stated::Report;
use crate::route::Route;
use crate::state::{Running, Shared};
use crate::store::redis::{JobEntered, RedisBackend};
use crate::store::{Admission, AdmitRequest, Charge, Store};
use crate::telemetry::access;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// How often an instance takes the slots granted to the fleet's jobs on each async route.
const COLLECT_EVERY: Duration = Duration::from_millis(200);

fn backend(shared: &Shared) -> Option<&Arc<RedisBackend>> {
    match &shared.store {
        Store::Redis(r) => Some(r.shared()),
        Store::Memory(_) => None,
    }
}

fn headers_json(h: &http::HeaderMap) -> Vec<u8> {
    let list: Vec<[String; 2]> = h
        .iter()
        .map(|(n, v)| [n.as_str().to_string(), B64.encode(v.as_bytes())])
        .collect();
    serde_json::to_vec(&list).unwrap_or_default()
}

fn headers_from(json: &[u8]) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let list: Vec<[String; 2]> = serde_json::from_slice(json).unwrap_or_default();
    list.into_iter()
        .filter_map(|[n, v]| {
            let name = http::HeaderName::from_bytes(n.as_bytes()).ok()?;
            let value = http::HeaderValue::from_bytes(&B64.decode(v).ok()?).ok()?;
            Some((name, value))
        })
        .collect()
}

type Record = HashMap<String, Vec<u8>>;

fn field<'a>(r: &'a Record, name: &str) -> &'a [u8] {
    r.get(name).map_or(&[], |v| v.as_slice())
}

fn text(r: &Record, name: &str) -> String {
    String::from_utf8_lossy(field(r, name)).into_owned()
}

async fn read(b: &RedisBackend, id: &str) -> Option<Record> {
    let flat: Vec<Vec<u8>> = b.job_record(id, "get", &[]).await.ok()?;
    let mut r = Record::new();
    for pair in flat.chunks(2) {
        if let [k, v] = pair {
            r.insert(String::from_utf8_lossy(k).into_owned(), v.clone());
        }
    }
    (!r.is_empty()).then_some(r)
}

/// Charges the job, writes its record and enters it in the route's queue.
pub async fn submit(
    shared: &Arc<Shared>,
    running: Arc<Running>,
    route: Arc<Route>,
    who: &Identity,
    admit: AdmitRequest,
    request: JobRequest,
    origin: Origin,
) -> Result<Submission, Admission> {
    let (Some(b), Some(rules), Some(cap)) = (backend(shared), route.jobs, route.max_in_flight)
    else {
        return Err(Admission::Unavailable);
    };
    let id = new_id();
    let ttl_ms = (rules.result_ttl.as_millis() as u64).to_string();
    // The record lives while the job may wait (result_ttl) and then be kept (result_ttl).
    let life = ((rules.result_ttl.as_millis() as u64) * 2 + 60_000).to_string();
    let key = hex::encode(who.hash);
    let headers = headers_json(&request.header.headers);
    let rid = origin.request_id.clone().unwrap_or_default();
    let fields: [&[u8]; 20] = [
        life.as_bytes(),
        b"key",
        key.as_bytes(),
        b"route",
        route.label.as_bytes(),
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
        b"pos",
    ];
    let mut args: Vec<&[u8]> = fields.to_vec();
    args.push(b"0");
    if b.job_record::<i64>(&id, "put", &args).await.is_err() {
        return Err(Admission::Unavailable);
    }
    let admit = AdmitRequest {
        key_cap: None,
        ..admit
    };
    let entered = b.enter_job(&admit, cap, &id).await;
    let (standing, position) = match entered {
        Ok(JobEntered::Queued(s, p)) => (s, p as usize),
        Ok(JobEntered::Taken(s)) => {
            if claim(b, &id).await {
                tokio::spawn(run_claimed(shared.clone(), id.clone(), route.label.clone()));
            }
            (s, 0)
        }
        Ok(JobEntered::Refused(a)) => {
            let _ = b.job_record::<i64>(&id, "cancel", &[]).await;
            return Err(a);
        }
        Err(e) => {
            // Maybe charged, maybe queued: the record is cancelled (a grant then finds it so
            // and passes the slot on) and whatever was charged given back.
            tracing::warn!(error = %e, "a job could not enter its route's queue");
            let _ = b.job_record::<i64>(&id, "cancel", &[]).await;
            if e.may_have_run() {
                shared.store.refund(&admit, Charge::Shared).await;
            }
            return Err(Admission::Unavailable);
        }
    };
    drop(running);
    Ok(Submission {
        id,
        standing,
        position,
    })
}

/// Claims a job whose slot this instance holds: `queued → running`, this runner's.
async fn claim(b: &RedisBackend, id: &str) -> bool {
    let alive = (b.lease_ttl().as_millis() as u64).to_string();
    let claimed = b
        .job_record::<i64>(id, "claim", &[b.instance().as_bytes(), alive.as_bytes()])
        .await;
    matches!(claimed, Ok(1))
}

/// A job as a poll sees it, with its route; `None`: not this key's, unknown or gone.
pub async fn view(shared: &Shared, id: &str, key: &KeyHash) -> Option<(Arc<str>, View)> {
    let b = backend(shared)?;
    let r = read(b, id).await?;
    if field(&r, "key") != hex::encode(key).as_bytes() {
        return None;
    }
    let route: Arc<str> = Arc::from(text(&r, "route"));
    if field(&r, "ended_now") == b"1" {
        metrics::ended(&route, "failed");
    }
    let view = match field(&r, "state") {
        b"queued" => View::Queued {
            position: text(&r, "pos").parse().unwrap_or(0),
        },
        b"running" => View::Running,
        b"expired" => View::Done(Arc::new(problem_result(
            Problem::RouteBusy,
            "the job found no free slot within async.result_ttl; its charge was refunded",
        ))),
        b"done" | b"failed" if field(&r, "lost") == b"1" => View::Done(Arc::new(problem_result(
            Problem::JobLost,
            "the instance running the job stopped; the upstream had it, so the charge stands and it is not run again",
        ))),
        b"done" | b"failed" => View::Done(Arc::new(Stored {
            status: text(&r, "status").parse().unwrap_or(502),
            headers: headers_from(field(&r, "rheaders")),
            body: Bytes::copy_from_slice(field(&r, "rbody")),
        })),
        _ => return None,
    };
    Some((route, view))
}

/// `DELETE`: takes a queued job out of its queue (refunded); `false` once it runs.
pub async fn cancel(shared: &Shared, running: &Running, id: &str, who: &Identity) -> bool {
    let Some(b) = backend(shared) else {
        return false;
    };
    let Some(r) = read(b, id).await else {
        return false;
    };
    let label = text(&r, "route");
    if field(&r, "state") != b"queued" {
        return false;
    }
    let granted = match b.job_leave(&label, id).await {
        Ok(0) => false,
        Ok(1) => true,
        _ => return false,
    };
    let cancelled = matches!(b.job_record::<i64>(id, "cancel", &[]).await, Ok(1));
    if granted {
        let _ = b.job_release(&label, id).await;
    }
    if cancelled {
        if let Some(route) = running.config.router.by_label(&label) {
            let admit = AdmitRequest {
                key_cap: None,
                ..decision::admit_request(route, who)
            };
            shared.store.refund(&admit, Charge::Shared).await;
        }
        metrics::ended(&label, "cancelled");
    }
    cancelled
}

/// Takes the slots granted to the fleet's jobs, on every async route, for as long as the
/// process runs: each grant goes to one instance's call, which confirms it, claims the job
/// and runs it.
pub fn start_collector(shared: Arc<Shared>) {
    let started = crate::background::spawn("tollgate-jobs".into(), move || async move {
        loop {
            tokio::time::sleep(COLLECT_EVERY).await;
            let Some(b) = backend(&shared) else { return };
            if shared.drain.is_draining() {
                // A draining instance starts no job: the others take the fleet's queue.
                return;
            }
            let running = shared.running();
            let routes: Vec<Arc<str>> = running
                .config
                .router
                .routes()
                .filter(|r| r.jobs.is_some())
                .map(|r| r.label.clone())
                .collect();
            for label in routes {
                let Ok(ids) = b.job_grants(&label).await else {
                    continue;
                };
                for id in ids {
                    if matches!(b.job_renew(&label, &id).await, Ok(true)) && claim(b, &id).await {
                        tokio::spawn(run_claimed(shared.clone(), Arc::from(id), label.clone()));
                    } else {
                        let _ = b.job_release(&label, &id).await;
                    }
                }
            }
        }
    });
    if let Err(e) = started {
        tracing::error!(error = %e, "cannot start the async jobs' collector");
    }
}

/// The identity a record's key hash pays as: its registry entry, else the default policy.
fn payer(running: &Running, key_hex: &[u8]) -> Option<Identity> {
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

fn request_of(r: &Record) -> Option<JobRequest> {
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

/// Runs a claimed job whose slot this instance holds, renewing both while it runs.
async fn run_claimed(shared: Arc<Shared>, id: Arc<str>, label: Arc<str>) {
    let Some(b) = backend(&shared).cloned() else {
        return;
    };
    let running = shared.running();
    let parts = async {
        let r = read(&b, &id).await?;
        let route = running.config.router.by_label(&label)?.clone();
        let who = payer(&running, field(&r, "key"))?;
        let request = request_of(&r)?;
        Some((r, route, who, request))
    };
    let Some((r, route, who, request)) = parts.await else {
        let _ = b.job_release(&label, &id).await;
        return;
    };
    let admit = AdmitRequest {
        key_cap: None,
        ..decision::admit_request(&route, &who)
    };
    let _drain = shared.drain.enter();
    let _state = InState::new(&label, "running");
    let every = b.lease_ttl() / 3;
    let renew = {
        let (b, id, label) = (b.clone(), id.clone(), label.clone());
        let alive = (b.lease_ttl().as_millis() as u64).to_string();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let _ = b.job_renew(&label, &id).await;
                let _ = b.job_record::<i64>(&id, "renew", &[alive.as_bytes()]).await;
            }
        })
    };
    let max = route.jobs.map_or(16 << 20, |j| j.max_response_body);
    let started = Instant::now();
    let sent = send::send(&shared, &running, &route, &request, max).await;
    let (state, stored, mut cost, upstream_status, follow) =
        settle(&shared, &route, &admit, sent, started).await;
    let rheaders = headers_json(&stored.headers.iter().cloned().collect());
    let status = stored.status.to_string();
    let _ = b
        .job_record::<i64>(
            &id,
            "finish",
            &[
                state.as_bytes(),
                b"status",
                status.as_bytes(),
                b"rheaders",
                &rheaders,
                b"rbody",
                &stored.body,
            ],
        )
        .await;
    if let Some(follow) = follow {
        // The slot follows the late answer (the result is readable meanwhile).
        follow.until_done().await;
        cost = route
            .fidelity
            .final_cost(admit.cost, Some(started.elapsed()));
        shared.store.settle(&admit, Charge::Shared, cost).await;
    }
    renew.abort();
    let _ = b.job_release(&label, &id).await;
    let result = if state == "done" { "done" } else { "failed" };
    metrics::ended(&label, result);
    let rm = running.metrics.get(&route);
    if cost > 0 {
        rm.cost_units.inc_by(cost);
    }
    if access::enabled() {
        let key = who.log_name();
        let rid = text(&r, "rid");
        access::write(&access::AccessRecord {
            method: request.header.method.as_str(),
            route: &label,
            key: &key,
            cost,
            decision: if result == "done" {
                "job_done"
            } else {
                "job_failed"
            },
            status: stored.status,
            latency_ms: started.elapsed().as_secs_f64() * 1e3,
            upstream_ms: None,
            store_ms: 0.0,
            queue_ms: 0.0,
            hold_ms: 0.0,
            upstream_status,
            request_id: (!rid.is_empty()).then_some(rid.as_str()),
            fallback: false,
            shadow: None,
            client: None,
            error: None,
            job: Some(&id),
        });
    }
}

/// A job's end: its state, result, charge and upstream status, and a late answer to follow.
type Settled = (
    &'static str,
    Stored,
    u64,
    Option<u16>,
    Option<Box<send::Follow>>,
);

/// The job's result, state and final charge, the charge settled as DESIGN §3 says.
async fn settle(
    shared: &Shared,
    route: &Route,
    admit: &AdmitRequest,
    sent: Sent,
    started: Instant,
) -> Settled {
    let store = &shared.store;
    let billed = |upstream: Duration| route.fidelity.final_cost(admit.cost, Some(upstream));
    match sent {
        Sent::Answer {
            stored,
            upstream,
            report,
        } => {
            let total = match report {
                Some(Report::Applied(units)) => units,
                _ => billed(upstream),
            };
            store.settle(admit, Charge::Shared, total).await;
            let status = stored.status;
            ("done", stored, total, Some(status), None)
        }
        Sent::Unreachable(_) => {
            store.refund(admit, Charge::Shared).await;
            let p = problem_result(
                Problem::BadGateway,
                "the upstream could not be reached; the job's charge was refunded",
            );
            ("failed", p, 0, None, None)
        }
        Sent::TimedOut(follow) => {
            // Charged; settled (for measured time) once the late answer has been followed.
            let _ = started;
            let p = problem_result(Problem::GatewayTimeout, "the upstream did not answer within read_timeout; it had the request, so the charge stands");
            ("failed", p, admit.cost, None, Some(follow))
        }
        Sent::TooLarge { upstream } => {
            let total = billed(upstream);
            store.settle(admit, Charge::Shared, total).await;
            let p = problem_result(Problem::JobResponseTooLarge, "the upstream's answer is larger than async.max_response_body; it did the work, so the charge stands");
            ("failed", p, total, None, None)
        }
        Sent::Broken { upstream, .. } => {
            let total = billed(upstream);
            store.settle(admit, Charge::Shared, total).await;
            let p = problem_result(
                Problem::BadGateway,
                "the upstream's answer broke off; it had the request, so the charge stands",
            );
            ("failed", p, total, None, None)
        }
    }
}
