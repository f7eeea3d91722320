//! Async jobs as a client sees them (DESIGN §8): a submission with `Prefer: respond-async`,
//! the job's location, and polls of it until it is done.

use std::time::{Duration, Instant};

use super::client::{get, header};
use super::gateway::Gateway;

/// A body sent chunked, without a declared length: `parts`, one chunk each.
pub fn chunked(parts: &[String]) -> reqwest::Body {
    let chunks: Vec<Result<String, std::io::Error>> = parts.iter().cloned().map(Ok).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
}

/// `POST url` as `key` asking for a job (`Prefer: respond-async`), with `body` and then
/// `headers`: the answer, whatever it is.
pub async fn post_async(
    c: &reqwest::Client,
    url: String,
    key: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    post_async_body(c, url, key, body.to_string().into(), headers).await
}

/// [`post_async`] with any body (one sent [`chunked`], say).
pub async fn post_async_body(
    c: &reqwest::Client,
    url: String,
    key: &str,
    body: reqwest::Body,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut rb = c
        .post(url)
        .header("X-API-Key", key)
        .header("Prefer", "respond-async");
    for (name, value) in headers {
        rb = rb.header(*name, *value);
    }
    rb.body(body).send().await.unwrap()
}

/// The location a 202 gave its job (under `/_tollgate/jobs/`).
pub fn job_location(accepted: &reqwest::Response) -> String {
    let location = header(accepted, "location").unwrap();
    assert!(location.starts_with("/_tollgate/jobs/"), "{location}");
    location
}

/// Polls the job at `location` on `gw` as `key` until it is no longer queued or running
/// (`within` at most): the final answer. Every 202 on the way has `Retry-After`, and passes
/// `each_202`.
pub async fn job_result(
    c: &reqwest::Client,
    gw: &Gateway,
    location: &str,
    key: &str,
    within: Duration,
    each_202: impl Fn(&reqwest::Response),
) -> reqwest::Response {
    let start = Instant::now();
    loop {
        let r = get(c, gw.url(location), key).await;
        if r.status() == 503 {
            // A poll the store did not answer in time (a loaded machine: `store.timeout` is
            // short in these tests) says nothing of the job: polled again. Any other 503 is
            // the job's answer, handed back as it came.
            let (status, headers) = (r.status(), r.headers().clone());
            let body = r.bytes().await.unwrap();
            if String::from_utf8_lossy(&body).contains("store-unavailable") {
                assert!(
                    start.elapsed() < within,
                    "job {location}: the store never answered"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let mut answer = http::Response::new(body);
            *answer.status_mut() = status;
            *answer.headers_mut() = headers;
            return answer.into();
        }
        if r.status() != 202 {
            return r;
        }
        assert!(header(&r, "retry-after").is_some());
        each_202(&r);
        assert!(start.elapsed() < within, "job {location} never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A job submission by `key` on `gw` whose route's queue is full (`max_queue` 1 on
/// `/reports/generate`, capped at 1) is refused at once (DESIGN §3), before its body: the
/// client waits for `100 Continue` and never sends the body, and still gets its 503 well
/// inside the default `body_timeout` (30 s). Said so, and counted as `route_busy` once.
/// (Before: the gateway waited for the body, and answered 408 after `body_timeout`.)
pub async fn refused_at_once_by_a_full_queue(gw: &Gateway, key: &str) {
    let port = gw.port;
    let head = format!(
        "POST /reports/generate HTTP/1.1\r\nHost: localhost\r\nX-API-Key: {key}\r\nPrefer: respond-async\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"
    );
    let asked = Instant::now();
    let r = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut s = super::raw_http::raw_connect(port);
        s.write_all(head.as_bytes()).unwrap();
        super::raw_http::read_raw_response(&mut s)
    })
    .await
    .unwrap();
    let after = asked.elapsed();
    let r = r.unwrap_or_else(|| panic!("no answer after {after:?}: it waited for the body"));
    assert_eq!(r.status, 503, "after {after:?}: {r:?}");
    assert!(after < Duration::from_secs(10), "answered after {after:?}");
    assert!(r.is_problem("route-busy"), "{r:?}");
    assert_eq!(
        r.json()["detail"],
        "/reports/generate allows 1 request in flight and its queue already holds 1 waiting (max_queue)"
    );
    super::gateway::assert_metric(
        gw,
        "tollgate_rejections_total{reason=\"route_busy\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
}

/// A job's `status` and `position` as a poll on `gw` shows them.
pub async fn job_place(
    c: &reqwest::Client,
    gw: &Gateway,
    location: &str,
    key: &str,
) -> (String, u64) {
    let r = get(c, gw.url(location), key).await;
    assert_eq!(r.status(), 202, "{location}");
    let v: serde_json::Value = r.json().await.unwrap();
    (
        v["status"].as_str().unwrap_or_default().to_string(),
        v["position"].as_u64().unwrap(),
    )
}

/// DESIGN §8's `position` on a route capped at 1 whose upstream takes seconds per request
/// (the polls between two hand-offs must fit; `target` a POST, async, results kept long
/// enough), submitted on `on` and
/// polled on `poll` (one gateway or two of a fleet): key a runs one job and queues two; key
/// b's one job, submitted last, is next in the fair order (b runs nothing, a runs one), so it
/// says 1 and a's last says 3; as the slot passes on, each says how many are still ahead of it.
pub async fn job_positions_follow_the_fair_order(
    up: &super::upstream::Upstream,
    on: &Gateway,
    poll: &Gateway,
    target: &str,
) {
    let c = super::client::client();
    let submit = async |key: &str| {
        let r = post_async(&c, on.url(target), key, "", &[]).await;
        assert_eq!(r.status(), 202, "{:?}", r.text().await);
        let location = job_location(&r);
        let v: serde_json::Value = r.json().await.unwrap();
        (location, v["position"].as_u64().unwrap())
    };
    let (a1, at) = submit("key-a").await;
    assert_eq!(at, 0, "a slot was free");
    up.wait_current(target, 1).await;
    let (a2, at2) = submit("key-a").await;
    let (a3, at3) = submit("key-a").await;
    let (b1, bt) = submit("key-b").await;
    assert_eq!(
        (at2, at3, bt),
        (1, 2, 1),
        "positions at submission: a2, a3, b1"
    );
    let place = async |location: &str, key: &str| job_place(&c, poll, location, key).await;
    let started = async |n: u64| {
        super::wait::eventually(Duration::from_secs(20), async || match up.count(target) {
            m if m == n => Ok(()),
            m => Err(format!("{m} started, waiting for {n}")),
        })
        .await
    };
    assert_eq!(place(&a2, "key-a").await, ("queued".into(), 2));
    assert_eq!(place(&a3, "key-a").await, ("queued".into(), 3));
    assert_eq!(place(&b1, "key-b").await, ("queued".into(), 1));
    // a1 ends: b1 runs, a's two move up.
    started(2).await;
    assert_eq!(
        up.keys_in_order(target).last().map(String::as_str),
        Some("key-b")
    );
    assert_eq!(place(&a2, "key-a").await, ("queued".into(), 1));
    assert_eq!(place(&a3, "key-a").await, ("queued".into(), 2));
    started(3).await;
    assert_eq!(place(&a3, "key-a").await, ("queued".into(), 1));
    for (location, key) in [
        (&a1, "key-a"),
        (&a2, "key-a"),
        (&a3, "key-a"),
        (&b1, "key-b"),
    ] {
        let done = job_result(&c, poll, location, key, Duration::from_secs(30), |_| {}).await;
        assert_eq!(done.status(), 200, "{location}");
    }
    assert_eq!(up.max_concurrent(target), 1);
}

/// Submits a job as `key-a` whose `max_delay` hold ends about `hold_s` seconds after
/// `charged` (when the key's budget was last full): its 202's `Retry-After`, and a poll's
/// right after, count the hold (about `hold_s`, less what has drained since `charged` on a
/// slow machine; at most 2 s more for its run). Its location.
pub async fn submit_held(
    c: &reqwest::Client,
    gw: &Gateway,
    route: &str,
    charged: Instant,
    hold_s: f64,
) -> String {
    let r = post_async(c, gw.url(route), "key-a", "", &[]).await;
    assert_eq!(r.status(), 202);
    let due = |charged: Instant| (hold_s - charged.elapsed().as_secs_f64()).ceil().max(1.0) as u64;
    let most = hold_s.ceil() as u64 + 2;
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!(
        (due(charged)..=most).contains(&retry),
        "Retry-After {retry}"
    );
    let location = job_location(&r);
    let r = get(c, gw.url(&location), "key-a").await;
    assert_eq!(r.status(), 202);
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!(
        (due(charged)..=most).contains(&retry),
        "poll's Retry-After {retry}"
    );
    location
}
