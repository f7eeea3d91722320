//! Async jobs as a client sees them (DESIGN §8): a submission with `Prefer: respond-async`,
//! the job's location, and polls of it until it is done.

use std::time::{Duration, Instant};

use super::client::{get, header};
use super::gateway::Gateway;

/// `POST url` as `key` asking for a job (`Prefer: respond-async`), with `body` and then
/// `headers`: the answer, whatever it is.
pub async fn post_async(
    c: &reqwest::Client,
    url: String,
    key: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut rb = c
        .post(url)
        .header("X-API-Key", key)
        .header("Prefer", "respond-async");
    for (name, value) in headers {
        rb = rb.header(*name, *value);
    }
    rb.body(body.to_string()).send().await.unwrap()
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
        if r.status() != 202 {
            return r;
        }
        assert!(header(&r, "retry-after").is_some());
        each_202(&r);
        assert!(start.elapsed() < within, "job {location} never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
