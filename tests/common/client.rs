//! The HTTP client side: requests with an API key, many at once, and what the answers say.

use std::time::Duration;

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A client that gives up on a request after `patience` (and closes its connection).
pub fn impatient(patience: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(patience)
        .build()
        .unwrap()
}

/// `GET url` with an API key.
pub async fn get(c: &reqwest::Client, url: impl reqwest::IntoUrl, key: &str) -> reqwest::Response {
    c.get(url).header("X-API-Key", key).send().await.unwrap()
}

/// `POST url` with an API key.
pub async fn post(c: &reqwest::Client, url: impl reqwest::IntoUrl, key: &str) -> reqwest::Response {
    c.post(url).header("X-API-Key", key).send().await.unwrap()
}

/// `POST url` with an API key, in the background: its status, once it is answered.
pub fn spawn_post(c: &reqwest::Client, url: String, key: &str) -> tokio::task::JoinHandle<u16> {
    let (c, key) = (c.clone(), key.to_string());
    tokio::spawn(async move { post(&c, url, &key).await.status().as_u16() })
}

/// A request's answer as a background task sees it: its status, `Retry-After` and body, or
/// the error that cut it off.
pub type Answer = Result<(u16, Option<String>, String), String>;

/// `POST url` with an API key, in the background: its [`Answer`].
pub fn spawn_post_answer(
    c: &reqwest::Client,
    url: String,
    key: &str,
) -> tokio::task::JoinHandle<Answer> {
    let req = c.post(url).header("X-API-Key", key);
    tokio::spawn(async move {
        let r = req.send().await.map_err(|e| e.to_string())?;
        let retry = header(&r, "Retry-After");
        Ok((r.status().as_u16(), retry, r.text().await.unwrap()))
    })
}

/// An exiting instance's answer to a request it will not forward (a held one, or one still
/// queued for a slot): 503 `route-busy`, `Retry-After: 1`, saying it is shutting down.
pub fn assert_answered_as_exiting(answer: Answer, what: &str) {
    let (status, retry, body) = answer.unwrap_or_else(|e| panic!("{what}: cut off: {e}"));
    assert_eq!(status, 503, "{what}: {body}");
    assert_eq!(retry.as_deref(), Some("1"), "{what}");
    assert!(
        body.contains("route-busy") && body.contains("shutting down"),
        "{what}: {body}"
    );
}

/// `POST url` with an API key, in the background, sent again while it is refused 503
/// `store-unavailable` (`on_error: deny` while a worker thread finds Redis restarted: never
/// admitted): the status of the first answer the store decided.
pub fn spawn_post_until_decided(
    c: &reqwest::Client,
    url: String,
    key: &str,
) -> tokio::task::JoinHandle<u16> {
    let (c, key) = (c.clone(), key.to_string());
    tokio::spawn(async move {
        loop {
            let r = post(&c, url.clone(), &key).await;
            let s = r.status().as_u16();
            if s == 503 && r.text().await.unwrap().contains("store-unavailable") {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
            return s;
        }
    })
}

/// `GET url` with an API key, in the background: its status, once it is answered.
pub fn spawn_get(c: &reqwest::Client, url: String, key: &str) -> tokio::task::JoinHandle<u16> {
    let (c, key) = (c.clone(), key.to_string());
    tokio::spawn(async move { get(&c, url, &key).await.status().as_u16() })
}

/// Sends `n` requests at once (`make(i)` builds the i-th) and returns the responses in order.
pub async fn all_at_once(
    n: usize,
    make: impl Fn(usize) -> reqwest::RequestBuilder,
) -> Vec<reqwest::Response> {
    let sends = (0..n).map(|i| {
        let rb = make(i);
        async move { rb.send().await.unwrap() }
    });
    futures_util::future::join_all(sends).await
}

/// The status codes of `responses`, sorted.
pub fn sorted_statuses(responses: &[reqwest::Response]) -> Vec<u16> {
    let mut s: Vec<u16> = responses.iter().map(|r| r.status().as_u16()).collect();
    s.sort();
    s
}

pub fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

/// `n` GETs of `url` without a key, one after another: each one's status and
/// `X-RateLimit-Remaining` ("" when absent).
pub async fn anonymous_gets(c: &reqwest::Client, url: &str, n: usize) -> Vec<(u16, String)> {
    let mut seen = vec![];
    for _ in 0..n {
        let r = c.get(url).send().await.unwrap();
        seen.push((
            r.status().as_u16(),
            header(&r, "X-RateLimit-Remaining").unwrap_or_default(),
        ));
    }
    seen
}

/// The entry for `route` in a JSON answer's `routes` array (`/admin/routes`, `/admin/costs`,
/// `/status.json`, `tollgate audit --json`), if it has one.
pub fn find_route<'a>(v: &'a serde_json::Value, route: &str) -> Option<&'a serde_json::Value> {
    v["routes"].as_array()?.iter().find(|r| r["route"] == route)
}

/// [`find_route`], or a panic that shows the whole answer.
pub fn route_entry<'a>(v: &'a serde_json::Value, route: &str) -> &'a serde_json::Value {
    find_route(v, route).unwrap_or_else(|| panic!("no route {route} in {v}"))
}
