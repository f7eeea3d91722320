//! The front door as API consumers behind HTTPS and load balancers reach it: TLS termination
//! (certificate made here, rotated on disk and reloaded), HTTP/2 streams charged and capped
//! like HTTP/1.1 requests, and the client address behind `identity.trusted_proxies`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;

/// A gateway with `server.tls` on a port of its own, serving the certificate in `pki`.
struct TlsGateway {
    gw: Gateway,
    tls_port: u16,
    /// The CA that signed the certificate the test rotates in (the client trusts both).
    roots: Vec<PathBuf>,
}

/// `body` with a budget that refills too slowly to change `remaining` during a test.
fn slow_refill(body: &str) -> String {
    body.replace("window: 60s", "window: 24h")
}

fn start_tls(upstream: &Upstream, pki: &Pki, body: &str, extra_roots: &[&Path]) -> TlsGateway {
    start_tls_with(upstream, pki, body, extra_roots, "")
}

/// With more `server:` lines.
fn start_tls_with(
    upstream: &Upstream,
    pki: &Pki,
    body: &str,
    extra_roots: &[&Path],
    server_more: &str,
) -> TlsGateway {
    for _attempt in 0..5 {
        let tls_port = free_port();
        let server_extra = format!(
            "  tls:\n    listen: \"127.0.0.1:{tls_port}\"\n    cert: \"{}\"\n    key: \"{}\"\n{server_more}",
            pki.cert_file.display(),
            pki.key_file.display()
        );
        let gw = Gateway::start_opts(GatewayOpts {
            upstream_url: upstream.url(),
            body,
            server_extra: &server_extra,
            ..GatewayOpts::default()
        });
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            // Read from /proc: a probe connection would hold one of `max_connections`.
            if listens_on(gw.pid(), tls_port) {
                let mut roots = vec![pki.ca_file.clone()];
                roots.extend(extra_roots.iter().map(|p| p.to_path_buf()));
                return TlsGateway {
                    gw,
                    tls_port,
                    roots,
                };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("the TLS listener did not start");
}

/// A TLS connection to `localhost` that trusts `roots` and offers `alpn`.
async fn tls_connect(
    port: u16,
    roots: &[PathBuf],
    alpn: &[&[u8]],
) -> TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    tls_over(tcp, roots, alpn).await
}

/// A TLS handshake over a TCP connection already open to the gateway.
async fn tls_over(
    tcp: tokio::net::TcpStream,
    roots: &[PathBuf],
    alpn: &[&[u8]],
) -> TlsStream<tokio::net::TcpStream> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        for c in rustls::pki_types::CertificateDer::pem_file_iter(r).unwrap() {
            store.add(c.unwrap()).unwrap();
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(store)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.unwrap()
}

/// The certificate the server presented.
fn served_cert(tls: &TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// One HTTP/2 connection to the gateway's TLS listener.
async fn h2_connect(tg: &TlsGateway) -> h2::client::SendRequest<bytes::Bytes> {
    h2_connect_closable(tg).await.0
}

/// [`h2_connect`], and its connection's task: aborting it closes the socket at once.
async fn h2_connect_closable(
    tg: &TlsGateway,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<()>,
) {
    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (client, conn) = h2::client::handshake(tls).await.unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (client, task)
}

struct H2Response {
    status: u16,
    version: http::Version,
    headers: http::HeaderMap,
    body: Vec<u8>,
}

impl H2Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn remaining(&self) -> u64 {
        self.header("x-ratelimit-remaining")
            .unwrap()
            .parse()
            .unwrap()
    }
}

fn h2_request(method: &str, path: &str, key: &str) -> http::Request<()> {
    http::Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .header("x-api-key", key)
        .body(())
        .unwrap()
}

/// Opens a `POST` stream that says `content-length: 100` and sends `first` of it, no more:
/// the answer's future and the body's sender (kept open while it is held).
async fn h2_unfinished_post(
    client: &h2::client::SendRequest<bytes::Bytes>,
    path: &str,
    headers: &[(&str, &str)],
    first: &'static [u8],
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-length", "100");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let mut c = client.clone().ready().await.unwrap();
    let (resp, mut send) = c.send_request(req.body(()).unwrap(), false).unwrap();
    send.send_data(bytes::Bytes::from_static(first), false)
        .unwrap();
    (resp, send)
}

/// Sends a bodyless request as a new stream and reads its whole response.
async fn h2_send(
    client: &h2::client::SendRequest<bytes::Bytes>,
    req: http::Request<()>,
) -> H2Response {
    let mut client = client.clone().ready().await.unwrap();
    let (resp, _) = client.send_request(req, true).unwrap();
    let resp = resp.await.unwrap();
    let (parts, mut body) = resp.into_parts();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    H2Response {
        status: parts.status.as_u16(),
        version: parts.version,
        headers: parts.headers,
        body: bytes,
    }
}

#[tokio::test]
async fn http2_over_tls_gets_200_with_rate_limit_headers() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls(&up, &pki, INCIDENT, &[]);

    let client = h2_connect(&tg).await;
    let r = h2_send(&client, h2_request("GET", "/widgets", "k1")).await;
    assert_eq!((r.status, r.version), (200, http::Version::HTTP_2));
    assert_eq!(r.header("ratelimit-policy"), Some("\"default\";q=120;w=60"));
    assert_eq!(r.header("x-ratelimit-limit"), Some("120"));
    assert_eq!(r.header("x-ratelimit-cost"), Some("1"));
    assert_eq!(r.remaining(), 119);
    assert!(r
        .header("ratelimit")
        .unwrap()
        .starts_with("\"default\";r=119;t="));

    // The upstream got HTTP/1.1 with the origin-form target, the client's authority as
    // X-Forwarded-Host, and the scheme the client used.
    let seen = up.api.seen();
    let last = seen.last().unwrap();
    assert_eq!(last.target, "/widgets");
    assert_eq!(last.header("x-forwarded-proto"), vec!["https"]);
    assert_eq!(last.header("x-forwarded-host"), vec!["localhost"]);
    assert_eq!(last.header("x-forwarded-for"), vec!["127.0.0.1"]);

    // A route's cost applies to a stream as to an HTTP/1.1 request, and so does a refusal:
    // a key without budget left gets its 429 on a stream of the same connection.
    let r = h2_send(&client, h2_request("POST", "/reports//generate", "k1")).await;
    assert_eq!((r.status, r.remaining()), (200, 99));
    assert_eq!(up.api.seen().last().unwrap().target, "/reports/generate");

    // HTTP/1.1 is offered on the same listener (ALPN http/1.1); it needs its Host.
    let mut tls = tls_connect(tg.tls_port, &tg.roots, &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    tls.write_all(
        b"GET /widgets HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k1\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut text = String::new();
    tls.read_to_string(&mut text).await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-ratelimit-remaining: 98\r\n"),
        "{text}"
    );
    assert!(text.contains("\"x-forwarded-proto\":\"https\""), "{text}");

    // The access log names the client address of the h2 stream.
    let access = tg.gw.access_log();
    assert!(
        access.iter().all(|l| l["client"] == "127.0.0.1"),
        "{access:?}"
    );
    assert_metric(&tg.gw, "tollgate_connections", 1.0).await;
    drop(client);
    assert_metric(&tg.gw, "tollgate_connections", 0.0).await;
}

#[tokio::test]
async fn twenty_streams_on_one_connection_are_each_charged() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls(&up, &pki, &slow_refill(INCIDENT), &[]);

    let client = h2_connect(&tg).await;
    let sends = (0..20).map(|i| {
        h2_send(
            &client,
            h2_request("GET", &format!("/items/{i}?delay_ms=50"), "k1"),
        )
    });
    let responses = futures_util::future::join_all(sends).await;
    assert!(responses.iter().all(|r| r.status == 200));
    let mut remaining: Vec<u64> = responses.iter().map(|r| r.remaining()).collect();
    remaining.sort();
    assert_eq!(
        remaining,
        (100..=119).collect::<Vec<u64>>(),
        "each stream charged once"
    );
    let r = h2_send(&client, h2_request("GET", "/items/x", "k1")).await;
    assert_eq!(r.remaining(), 99);
    assert_metric(&tg.gw, "tollgate_cost_units_total{route=\"default\"}", 21.0).await;
    assert_metric(&tg.gw, "tollgate_connections", 1.0).await;
}

#[tokio::test]
async fn refused_streams_leave_the_connection_alone() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls(&up, &pki, &slow_refill(INCIDENT), &[]);

    // 120 units, 20 a report: 6 fit, 14 streams of the same connection are refused.
    let client = h2_connect(&tg).await;
    let sends = (0..20).map(|_| h2_send(&client, h2_request("POST", "/reports/generate", "k1")));
    let responses = futures_util::future::join_all(sends).await;
    let mut statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    statuses.sort();
    assert_eq!(statuses, [vec![200; 6], vec![429; 14]].concat());
    for r in responses.iter().filter(|r| r.status == 429) {
        assert!(r.header("retry-after").is_some());
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let p: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert!(p["type"].as_str().unwrap().ends_with("quota-exceeded"));
    }
    assert_eq!(up.count("/reports/generate"), 6);
    // The connection still serves: another key's stream goes through.
    let r = h2_send(&client, h2_request("GET", "/widgets", "k2")).await;
    assert_eq!((r.status, r.remaining()), (200, 119));
    // An unidentified stream: 401, and the connection still serves.
    let anon = http::Request::builder()
        .uri("https://localhost/widgets")
        .body(())
        .unwrap();
    assert_eq!(h2_send(&client, anon).await.status, 401);
    let r = h2_send(&client, h2_request("GET", "/widgets", "k2")).await;
    assert_eq!((r.status, r.remaining()), (200, 118));
    assert!(error_lines(&tg.gw).is_empty(), "{:?}", error_lines(&tg.gw));
}

#[tokio::test]
async fn route_cap_holds_across_streams_of_one_connection() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = incident_with_report_caps("      max_in_flight: 2\n      queue_timeout: 20s\n");
    let tg = start_tls(&up, &pki, &body, &[]);

    let client = h2_connect(&tg).await;
    let sends = (0..6).map(|_| {
        h2_send(
            &client,
            h2_request("POST", "/reports/generate?work_ms=300", "k1"),
        )
    });
    let responses = futures_util::future::join_all(sends).await;
    assert!(responses.iter().all(|r| r.status == 200));
    assert_eq!(up.count("/reports/generate"), 6);
    assert_eq!(
        up.max_concurrent("/reports/generate"),
        2,
        "the cap, and only the cap"
    );
}

/// A TLS gateway (its PKI in the directory returned) where `/reports/generate` has one slot
/// and a 20 s queue.
fn one_report_slot() -> (Upstream, tempfile::TempDir, TlsGateway) {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = slow_refill(&incident_with_report_caps(
        "      max_in_flight: 1\n      queue_timeout: 20s\n",
    ));
    let tg = start_tls(&up, &pki, &body, &[]);
    (up, dir, tg)
}

/// A stream reset while its request is with the upstream keeps its slot (and its charge)
/// until the upstream is done; one reset while queued is never forwarded nor charged.
#[tokio::test]
async fn a_reset_stream_is_a_client_that_went_away() {
    let (up, _dir, tg) = one_report_slot();
    let path = "/reports/generate";

    let client = h2_connect(&tg).await;
    let mut c = client.clone().ready().await.unwrap();
    // A is with the upstream (1.5 s of work), then the client resets it.
    let (a, mut a_stream) = c
        .send_request(
            h2_request("POST", "/reports/generate?work_ms=1500", "k1"),
            false,
        )
        .unwrap();
    a_stream.send_data(bytes::Bytes::new(), true).unwrap();
    up.wait_current(path, 1).await;
    let reset_at = Instant::now();
    a_stream.send_reset(h2::Reason::CANCEL);
    drop(a);

    // B, queued behind A's slot on the same connection, is reset while waiting.
    let mut c = client.clone().ready().await.unwrap();
    let (b, mut b_stream) = c
        .send_request(
            h2_request("POST", "/reports/generate?work_ms=10", "k2"),
            true,
        )
        .unwrap();
    wait_metric(
        &tg.gw,
        "tollgate_queued{route=\"/reports/generate\"}",
        1.0,
        Duration::from_secs(10),
    )
    .await;
    b_stream.send_reset(h2::Reason::CANCEL);
    drop(b);

    // C waits for the slot that A's upstream work still holds.
    let r = h2_send(
        &client,
        h2_request("POST", "/reports/generate?work_ms=10", "k1"),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(
        reset_at.elapsed() >= Duration::from_millis(1000),
        "C ran {:?} after A's reset: the slot was freed before the upstream finished",
        reset_at.elapsed()
    );
    assert_eq!(up.max_concurrent(path), 1);
    // A (charged 1) and C: k1 has 118 left. B was never forwarded, and k2 never charged.
    assert_eq!(r.remaining(), 118, "{}", tg.gw.log());
    assert_eq!(up.count(path), 2);
    let r = h2_send(&client, h2_request("GET", "/widgets", "k2")).await;
    assert_eq!((r.status, r.remaining()), (200, 119));
    let gone = tg
        .gw
        .wait_access(1, |l| l["decision"] == "client_gone")
        .await;
    // Answered to nobody: 499, nginx's "client closed request" (it was 0).
    assert_eq!(gone[0]["status"], 499);
    assert!(error_lines(&tg.gw).is_empty(), "{:?}", error_lines(&tg.gw));
    assert_metric(
        &tg.gw,
        "tollgate_in_flight{route=\"/reports/generate\"}",
        0.0,
    )
    .await;
    let text = reqwest::get(tg.gw.admin("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("tollgate_requests_total{route=\"/reports/generate\",status=\"499\"}"),
        "{text}"
    );
    assert!(!text.contains("status=\"0\""), "{text}");
}

/// A client that closes its whole HTTP/2 connection (a timeout in curl, a killed process)
/// while its request is with the upstream went away as one that resets the stream: the slot
/// (and the charge) stay until the upstream is done.
#[tokio::test]
async fn a_closed_http2_connection_is_a_client_that_went_away() {
    let (up, _dir, tg) = one_report_slot();
    let path = "/reports/generate";
    for method in ["GET", "POST"] {
        let (client, conn) = h2_connect_closable(&tg).await;
        let mut c = client.clone().ready().await.unwrap();
        // The POST's body in a frame of its own: the upstream has the whole request once it
        // ended (a GET's head ends it).
        let (a, mut a_stream) = c
            .send_request(
                h2_request(method, "/reports/generate?work_ms=1500", "k1"),
                method == "GET",
            )
            .unwrap();
        if method == "POST" {
            a_stream
                .send_data(bytes::Bytes::from_static(b"{\"rows\": 1}"), true)
                .unwrap();
        }
        up.wait_current(path, 1).await;
        let closed_at = Instant::now();
        conn.abort();
        drop((a, c, client));

        let other = h2_connect(&tg).await;
        let r = h2_send(
            &other,
            h2_request(method, "/reports/generate?work_ms=10", "k2"),
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(
            closed_at.elapsed() >= Duration::from_millis(1000),
            "{method}: ran {:?} after the connection closed: the slot was freed before the upstream finished",
            closed_at.elapsed()
        );
        assert_eq!(up.max_concurrent(path), 1, "{method}");
    }
    assert_eq!(up.count(path), 4);
}

/// One stream on a new HTTP/2 connection, then the connection is left idle: the gateway
/// closes it `idle` after that stream ended (no sooner than `idle` after it began, within 4 s
/// more of its answer).
async fn assert_h2_closed_when_idle(tg: &TlsGateway, idle: Duration) {
    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    let (client, conn) = h2::client::handshake(tls).await.unwrap();
    let conn = tokio::spawn(conn);
    // The gateway's idle clock starts once the stream has ended, so after this.
    let asked = Instant::now();
    let r = h2_send(&client, h2_request("GET", "/widgets", "k1")).await;
    assert_eq!(r.status, 200);
    let answered = Instant::now();
    // The connection's task ends when the gateway closes the connection.
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    let (since_asked, since_answered) = (asked.elapsed(), answered.elapsed());
    assert!(
        ended.is_ok(),
        "the idle connection is still open after 10 s"
    );
    assert!(
        since_asked >= idle && since_answered < idle + Duration::from_secs(4),
        "closed {since_answered:?} after the last stream, idle_timeout {idle:?}"
    );
    wait_metric(&tg.gw, "tollgate_connections", 0.0, Duration::from_secs(10)).await;
}

/// An HTTP/2 connection without an open stream is idle: closed `idle_timeout` after its last
/// stream ended. Pingora's h2 server takes the setting once, so a reload that changes it says
/// it applies to HTTP/2 at restart only, and HTTP/2 connections keep the first value (README).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_after_idle_timeout() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls_with(&up, &pki, INCIDENT, &[], "  idle_timeout: 1s\n");
    assert_h2_closed_when_idle(&tg, Duration::from_secs(1)).await;

    tg.gw.edit_config("idle_timeout: 1s", "idle_timeout: 1m");
    tg.gw.reload(0.0).await;
    tg.gw
        .wait_log("server.idle_timeout takes effect on restart only for HTTP/2 connections")
        .await;
    assert_h2_closed_when_idle(&tg, Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_front_door_for_both_listeners() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls_with(
        &up,
        &pki,
        INCIDENT,
        &[],
        "  max_connections: 1\n  header_timeout: 1s\n",
    );
    // The harness opens no connection of its own (it reads /proc to see the listeners).
    assert_metric(&tg.gw, "tollgate_connections", 0.0).await;
    // A TLS connection that never says a word is closed after header_timeout.
    let mut silent = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    let mut buf = [0u8; 64];
    let start = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => continue, // the server's SETTINGS
            Ok(_) => break,
            Err(_) => panic!("a silent h2 connection was kept open"),
        }
    }
    assert!(start.elapsed() >= Duration::from_millis(900));
    assert_metric(
        &tg.gw,
        "tollgate_client_timeouts_total{kind=\"header\"}",
        1.0,
    )
    .await;
    assert_metric(&tg.gw, "tollgate_connections", 0.0).await;
    // Nor one that sends part of the connection preface and stops (it was kept open for
    // good: a few such clients held every connection max_connections allows).
    let mut partial = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    partial
        .write_all(&b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..10])
        .await
        .unwrap();
    partial.flush().await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), partial.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => continue,
            Ok(_) => break,
            Err(_) => panic!("an h2 connection with part of its preface was kept open"),
        }
    }
    assert_metric(
        &tg.gw,
        "tollgate_client_timeouts_total{kind=\"header\"}",
        2.0,
    )
    .await;
    assert_metric(&tg.gw, "tollgate_connections", 0.0).await;

    // max_connections counts the plain and the TLS listener together.
    let mut plain = raw_connect(tg.gw.port);
    std::io::Write::write_all(
        &mut plain,
        b"GET /widgets HTTP/1.1\r\nHost: x\r\nX-API-Key: k1\r\n\r\n",
    )
    .unwrap();
    assert_eq!(read_raw_response(&mut plain).unwrap().status, 200);
    assert_metric(&tg.gw, "tollgate_connections", 1.0).await;
    // Refused at accept, before its handshake (DESIGN §1: handshakes count).
    let refused_before = metric(&tg.gw, "tollgate_connections_refused_total").await;
    assert_eq!(refused_before, 0.0);
    let mut tcp = raw_connect(tg.tls_port);
    std::io::Write::write_all(&mut tcp, PARTIAL_CLIENT_HELLO).unwrap_or_default();
    tokio::task::block_in_place(|| {
        assert!(
            closes_within(&mut tcp, Duration::from_millis(900)),
            "not refused at once"
        );
    });
    assert_metric(
        &tg.gw,
        "tollgate_connections_refused_total",
        refused_before + 1.0,
    )
    .await;
    drop(plain);
    assert_metric(&tg.gw, "tollgate_connections", 0.0).await;
    let client = h2_connect(&tg).await;
    assert_eq!(
        h2_send(&client, h2_request("GET", "/widgets", "k1"))
            .await
            .status,
        200
    );
}

/// A stream reset while the upstream works on a capped route keeps its charge following the
/// upstream, as its slot does (DESIGN §3, §6): the cost the late answer states becomes the
/// final charge, and a `cost_per_second` route bills the upstream's time to its answer, as
/// for an HTTP/1.1 client that leaves. (Before, the charge was fixed at the reset: the stated
/// 40 was never applied, and the per-second route billed 0.3 s of the upstream's 1.5.)
#[tokio::test]
async fn a_reset_streams_charge_follows_the_upstreams_late_answer() {
    reset_streams_charge_follows_the_late_answer(", max_in_flight: 2").await;
}

/// The same on routes without a cap (no slot to follow): the charge still follows the
/// upstream's late answer. (It stayed the admission's, 2 and 4: resetting every stream just
/// before its answer made a client pay the admission cost for whatever the upstream did.)
#[tokio::test]
async fn an_uncapped_reset_streams_charge_follows_the_upstreams_late_answer() {
    reset_streams_charge_follows_the_late_answer("").await;
}

/// `cap`: what each route's line ends with.
async fn reset_streams_charge_follows_the_late_answer(cap: &str) {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = format!(
        "rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n    /cfr: {{cost: 2, cost_from_response: X-Actual-Cost{cap}}}\n    /cps: {{cost: 1, cost_per_second: 10{cap}}}\n"
    );
    let tg = start_tls_with(&up, &pki, &body, &[], "");
    let client = h2_connect(&tg).await;
    for (path, key, charged) in [
        ("/cfr?delay_ms=1500&actual_cost=40", "k-cfr", 40u64),
        // 1 + 10 units a second for the upstream's 1.5 s at least (more on a slow machine);
        // 4 at the reset.
        ("/cps?delay_ms=1500", "k-cps", 16),
    ] {
        let route = path.split('?').next().unwrap();
        let mut c = client.clone().ready().await.unwrap();
        let (resp, mut stream) = c.send_request(h2_request("GET", path, key), false).unwrap();
        stream.send_data(bytes::Bytes::new(), true).unwrap();
        up.wait_current(route, 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        stream.send_reset(h2::Reason::CANCEL);
        drop(resp);
        // Once the upstream has answered, the final charge is counted (not at the reset)...
        let units = format!("tollgate_cost_units_total{{route=\"{route}\"}}");
        wait_metric_at_least(&tg.gw, &units, 15.0).await;
        // ...and the key's budget shows it: 1000 - the final charge - this request's 1.
        let r = h2_send(&client, h2_request("GET", "/x", key)).await;
        let final_charge = 1000 - 1 - r.remaining();
        assert_eq!(metric(&tg.gw, &units).await, final_charge as f64, "{path}");
        if route == "/cfr" {
            assert_eq!(final_charge, charged, "{path}");
        } else {
            assert!(final_charge >= charged, "{path}: {final_charge}");
        }
    }
}

#[tokio::test]
async fn a_stream_reset_while_held_by_max_delay_is_never_forwarded() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = "rate_limits:\n  default: {cost: 1, window: 20s, max_cost: 2, max_delay: 30s}\n";
    let tg = start_tls(&up, &pki, body, &[]);
    let client = h2_connect(&tg).await;
    for _ in 0..2 {
        assert_eq!(
            h2_send(&client, h2_request("GET", "/held", "k1"))
                .await
                .status,
            200
        );
    }
    // The third fits only in 10 s: held (counted in flight while held); the client resets it
    // meanwhile.
    wait_idle(&tg.gw, "default").await;
    let mut c = client.clone().ready().await.unwrap();
    let (held, mut stream) = c
        .send_request(h2_request("GET", "/held", "k1"), true)
        .unwrap();
    wait_in_flight(&tg.gw, "default", 1).await;
    stream.send_reset(h2::Reason::CANCEL);
    drop(held);
    tg.gw
        .wait_access(1, |l| l["decision"] == "client_gone")
        .await;
    assert_eq!(up.count("/held"), 2);
    // Another key on the same connection is served at once.
    assert_eq!(
        h2_send(&client, h2_request("GET", "/held", "k2"))
            .await
            .status,
        200
    );
}

/// Copies `from`'s certificate and key over the files the gateway was started with.
fn rotate(to: &Pki, from: &Pki) {
    std::fs::copy(&from.cert_file, &to.cert_file).unwrap();
    std::fs::copy(&from.key_file, &to.key_file).unwrap();
}

#[tokio::test]
async fn a_certificate_rotated_on_disk_is_served_after_reload() {
    let up = Upstream::start(Duration::ZERO);
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (first, second) = (Pki::new(d1.path()), Pki::new(d2.path()));
    let tg = start_tls(&up, &first, INCIDENT, &[&second.ca_file]);

    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(served_cert(&tls), first.cert_der);
    rotate(&first, &second);
    tg.gw.signal("HUP");
    assert_metric(&tg.gw, "tollgate_config_reloads_total{result=\"ok\"}", 1.0).await;
    let tls2 = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(
        served_cert(&tls2),
        second.cert_der,
        "the new certificate after SIGHUP"
    );
    // And it serves requests.
    let (client, conn) = h2::client::handshake(tls2).await.unwrap();
    tokio::spawn(conn);
    let tg_client = client;
    let r = h2_send(&tg_client, h2_request("GET", "/widgets", "k1")).await;
    assert_eq!(r.status, 200);
}

/// `server.tls`'s listener is restart-only, and `/admin/config` shows the running one
/// (README: a reload keeps restart-only values, "`/admin/config` shows those"): a reload that
/// moves `tls.listen`, then one that removes `server.tls`, leaves the listener serving where it
/// was, and the config shown says so. (Before, it showed the file's address, then no `tls` at
/// all, while the old listener answered.)
#[tokio::test]
async fn a_reload_shows_the_running_tls_listener() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls(&up, &pki, INCIDENT, &[]);
    let running = format!("127.0.0.1:{}", tg.tls_port);
    let moved = format!("127.0.0.1:{}", free_port());
    tg.gw.edit_config(&running, &moved);
    tg.gw.reload(0.0).await;
    tg.gw
        .wait_log("server.tls.listen takes effect on restart only; keeping the running listener")
        .await;
    let config = admin_text(&tg.gw, "/admin/config").await;
    assert!(
        config.contains(&running) && !config.contains(&moved),
        "{config}"
    );
    let yaml = std::fs::read_to_string(&tg.gw.config_path).unwrap();
    let start = yaml.find("  tls:\n").unwrap();
    // The block: `tls:` and its three lines (listen, cert, key).
    let block: String = yaml[start..]
        .lines()
        .take(4)
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(block.contains("key:"), "{block}");
    tg.gw.edit_config(&block, "");
    tg.gw.reload(1.0).await;
    tg.gw
        .wait_log("removing server.tls takes effect on restart only")
        .await;
    let config = admin_text(&tg.gw, "/admin/config").await;
    assert!(config.contains(&running), "{config}");
    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(
        served_cert(&tls),
        pki.cert_der,
        "the running listener still serves"
    );
}

#[tokio::test]
async fn a_bad_certificate_on_reload_keeps_the_old_one() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls(&up, &pki, INCIDENT, &[]);

    std::fs::write(&pki.cert_file, "not a certificate\n").unwrap();
    tg.gw.signal("HUP");
    assert_metric(
        &tg.gw,
        "tollgate_config_reloads_total{result=\"error\"}",
        1.0,
    )
    .await;
    tg.gw.wait_log("server.tls.cert: no certificate in").await;
    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(
        served_cert(&tls),
        pki.cert_der,
        "the running certificate stays"
    );

    // A key that belongs to another certificate is refused the same way.
    let other = tempfile::tempdir().unwrap();
    let other = Pki::new(other.path());
    std::fs::write(&pki.cert_file, std::fs::read(&other.cert_file).unwrap()).unwrap();
    tg.gw.signal("HUP");
    assert_metric(
        &tg.gw,
        "tollgate_config_reloads_total{result=\"error\"}",
        2.0,
    )
    .await;
    tg.gw.wait_log("does not match the certificate").await;
    let tls = tls_connect(tg.tls_port, &tg.roots, &[b"h2"]).await;
    assert_eq!(served_cert(&tls), pki.cert_der);
}

#[test]
fn check_validates_the_tls_files() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    std::fs::write(
        &pki.key_file,
        "-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "server:\n  tls: {{listen: \"127.0.0.1:8443\", cert: \"{}\", key: \"{}\"}}\nupstream: {{url: \"http://127.0.0.1:3000\"}}\nidentity:\n  trusted_proxies: [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n{INCIDENT}",
            dir.path().join("nope.crt").display(),
            pki.key_file.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("server.tls.cert: cannot read \""), "{text}");
    assert!(
        text.contains("identity.trusted_proxies[1]: expected a CIDR"),
        "{text}"
    );
}

/// What the upstream was told about the client of its last request.
fn last_forwarded_for(up: &Upstream) -> Vec<String> {
    up.api
        .seen()
        .last()
        .unwrap()
        .header("x-forwarded-for")
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[tokio::test]
async fn only_trusted_proxies_name_the_client() {
    let up = Upstream::start(Duration::ZERO);
    // 127.0.0.2 is the load balancer; 127.0.0.1 is a client that reaches the gateway directly.
    let body = format!(
        "identity:\n  anonymous: client_ip\n  trusted_proxies: [\"127.0.0.2/32\"]\n{}",
        slow_refill(INCIDENT)
    );
    let gw = Gateway::start(&up, &body);
    let direct = reqwest::Client::builder()
        .local_address("127.0.0.1".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let balancer = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let send = |c: &reqwest::Client, xff: &str| {
        c.get(gw.url("/widgets"))
            .header("X-Forwarded-For", xff)
            .send()
    };
    let remaining = |r: &reqwest::Response| header(r, "x-ratelimit-remaining").unwrap();

    // A direct client cannot choose its budget: whatever it claims, it pays as 127.0.0.1,
    // and the upstream hears only its real address.
    let r = send(&direct, "198.51.100.1").await.unwrap();
    assert_eq!((r.status().as_u16(), remaining(&r)), (200, "119".into()));
    assert_eq!(last_forwarded_for(&up), vec!["127.0.0.1"]);
    let r = send(&direct, "198.51.100.2").await.unwrap();
    assert_eq!(remaining(&r), "118");

    // Behind the balancer, two forwarded clients draw from two budgets.
    let r = send(&balancer, "198.51.100.1").await.unwrap();
    assert_eq!(remaining(&r), "119");
    assert_eq!(last_forwarded_for(&up), vec!["198.51.100.1, 127.0.0.2"]);
    let r = send(&balancer, "198.51.100.2").await.unwrap();
    assert_eq!(remaining(&r), "119");
    // What the client itself put left of its address proves nothing: the right-most
    // untrusted address pays.
    let r = send(&balancer, "203.0.113.66, 198.51.100.1").await.unwrap();
    assert_eq!(remaining(&r), "118");
    assert_eq!(
        last_forwarded_for(&up),
        vec!["203.0.113.66, 198.51.100.1, 127.0.0.2"]
    );
    // The balancer's own budget is untouched by its clients, and the direct client's too.
    let r = balancer.get(gw.url("/widgets")).send().await.unwrap();
    assert_eq!(remaining(&r), "119");
    let r = send(&direct, "127.0.0.2").await.unwrap();
    assert_eq!(remaining(&r), "117");
    // (Sorted: a request is logged just after its response, so two workers may log out of order.)
    let mut clients: Vec<String> = gw
        .wait_access(7, |_| true)
        .await
        .iter()
        .map(|l| l["client"].as_str().unwrap_or("").to_string())
        .collect();
    clients.sort();
    assert_eq!(
        clients,
        [
            "127.0.0.1",
            "127.0.0.1",
            "127.0.0.1",
            "127.0.0.2",
            "198.51.100.1",
            "198.51.100.1",
            "198.51.100.2",
        ]
    );
}

// ---- Handshakes inside header_timeout and max_connections (DESIGN §1) ----

/// The first bytes of a TLS ClientHello record (header and the start of the handshake), so
/// that the server waits for the rest.
const PARTIAL_CLIENT_HELLO: &[u8] = &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_handshakes_count_against_max_connections_and_header_timeout() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls_with(
        &up,
        &pki,
        INCIDENT,
        &[],
        "  max_connections: 50\n  header_timeout: 2s\n",
    );
    wait_metric(&tg.gw, "tollgate_connections", 0.0, Duration::from_secs(10)).await;
    let opened = Instant::now();
    let mut silent: Vec<std::net::TcpStream> = (0..100)
        .map(|i| {
            let mut s = raw_connect(tg.tls_port);
            if i % 2 == 1 {
                s.write_all(PARTIAL_CLIENT_HELLO).unwrap();
            }
            s
        })
        .collect();
    // Past the limit: refused at once, and the handshakes in progress are counted.
    wait_metric(
        &tg.gw,
        "tollgate_connections_refused_total",
        50.0,
        Duration::from_secs(3),
    )
    .await;
    assert_metric(&tg.gw, "tollgate_connections", 50.0).await;
    let refused_after = opened.elapsed();
    assert!(refused_after < Duration::from_secs(2), "{refused_after:?}");
    // The rest are closed when header_timeout ends without a finished handshake.
    let all_closed = tokio::task::block_in_place(|| {
        let start = Instant::now();
        loop {
            let closed = silent.iter_mut().map(is_closed).filter(|&c| c).count();
            if closed == silent.len() {
                return opened.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{closed} of 100 closed"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    eprintln!("refused after {refused_after:?}, stalled handshakes closed after {all_closed:?}");
    assert!(
        all_closed >= Duration::from_millis(1800) && all_closed < Duration::from_secs(5),
        "stalled handshakes closed after {all_closed:?} with header_timeout 2s"
    );
    wait_metric(&tg.gw, "tollgate_connections", 0.0, Duration::from_secs(3)).await;
    assert_metric(
        &tg.gw,
        "tollgate_client_timeouts_total{kind=\"header\"}",
        50.0,
    )
    .await;
    // And a real client is served afterwards.
    let client = h2_connect(&tg).await;
    let r = h2_send(&client, h2_request("GET", "/widgets", "after")).await;
    assert_eq!(r.status, 200);
}

// ---- server.body_timeout over HTTP/2 (DESIGN §3) ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_http2_body_gets_408_frees_the_slot_and_stays_charged() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = "rate_limits:\n  default: {cost: 1, window: 24h, max_cost: 1000}\n  endpoints:\n    \"POST /upload\": {cost: 1, max_in_flight: 1}\n";
    let tg = start_tls_with(&up, &pki, body, &[], "  body_timeout: 1s\n");
    let client = h2_connect(&tg).await;
    let (resp, send) =
        h2_unfinished_post(&client, "/upload", &[("x-api-key", "staller")], b"x").await;
    up.wait_current("/upload", 1).await;
    let stalled_at = Instant::now();
    let other = || {
        http::Request::builder()
            .method("POST")
            .uri("https://localhost/upload")
            .header("x-api-key", "other")
            .body(())
            .unwrap()
    };
    assert_eq!(h2_send(&client, other()).await.status, 503, "slot held");
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("no answer to the stalled stream");
    let after = stalled_at.elapsed();
    eprintln!("stalled HTTP/2 body answered after {after:?} (body_timeout 1s)");
    match resp {
        Ok(r) => assert_eq!(r.status(), 408),
        Err(e) => assert!(e.is_reset(), "{e:?}"),
    }
    assert!(after < Duration::from_secs(4), "gave up after {after:?}");
    // The slot is free again, and the stalled request stayed charged (1000 - 1 - 1).
    let start = Instant::now();
    let r = loop {
        let r = h2_send(&client, h2_request("POST", "/upload", "staller")).await;
        if r.status == 200 {
            break r;
        }
        assert_eq!(r.status, 503);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the slot was never released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.remaining(), 998);
    assert_metric(&tg.gw, "tollgate_client_timeouts_total{kind=\"body\"}", 1.0).await;
    drop(send);
}

/// An HTTP/2 stream whose upstream answered at once, without reading its body, gives its slot
/// back once that answer is sent, though its client leaves the body unfinished: the
/// upstream's work is done (DESIGN §3: the slot is kept "until the upstream has answered"),
/// and nothing times an HTTP/2 body out after the answer. Before, two such streams held a
/// cap of 2 for as long as their client kept the connection, every other key refused
/// `route-busy`. An answer without a body (a 204) too: it has no body for its end to be seen
/// on, and held the slot after the first fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_http2_stream_with_an_unfinished_body_frees_its_slot() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = "rate_limits:\n  default: {cost: 1, window: 24h, max_cost: 1000}\n  endpoints:\n    \"POST /early\": {cost: 1, max_in_flight: 1, queue_timeout: 100ms}\n";
    let tg = start_tls_with(&up, &pki, body, &[], "  body_timeout: 30s\n");
    let client = h2_connect(&tg).await;
    let mut held = vec![];
    for (n, (target, status)) in [("/early", 200), ("/early?status=204", 204)]
        .into_iter()
        .enumerate()
    {
        let (resp, send) =
            h2_unfinished_post(&client, target, &[("x-api-key", "holder")], b"x").await;
        // The upstream (an echo that reads no body) answers at once.
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .expect("no answer")
            .unwrap();
        assert_eq!(resp.status(), status);
        held.push(send);
        let answered = Instant::now();
        // Freed at once, not after body_timeout (30 s), nor when the client ends the stream.
        loop {
            let r = h2_send(&client, h2_request("POST", "/early", "other")).await;
            if r.status == 200 {
                break;
            }
            assert_eq!(r.status, 503, "{target}");
            assert!(
                answered.elapsed() < Duration::from_secs(5),
                "{target}: the slot was never released"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The holders' streams are still open, each charged once.
        assert_eq!(up.count("/early"), 2 * (n as u64 + 1));
    }
    drop(held);
}

/// An HTTP/2 request without `content-length` whose body ends with an empty DATA frame (as
/// `curl --http2 -T -` sends it) reaches an HTTP/1 upstream with one chunked terminator.
/// Pingora wrote the empty last chunk as a terminator and then its own: the upstream read a
/// second request, `0`, answered 400 on the pooled connection, and the next request on it
/// (another key's) got a 502 it was charged for, never having reached the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_last_data_frame_ends_the_upstream_body_once() {
    use std::io::{Read, Write};
    let up = Upstream::start(Duration::ZERO);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let raw_port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        // The whole request, then 300 ms more of whatever follows it on the connection.
        while !got.windows(5).any(|w| w == b"0\r\n\r\n") {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        conn.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let _ = tx.send(got);
    });
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = format!(
        "upstreams:\n  raw: {{url: \"http://127.0.0.1:{raw_port}\"}}\nrate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n    /raw: {{upstream: raw}}\n"
    );
    let tg = start_tls(&up, &pki, &body, &[]);
    let client = h2_connect(&tg).await;
    let req = http::Request::builder()
        .method("POST")
        .uri("https://localhost/raw")
        .header("x-api-key", "k")
        .body(())
        .unwrap();
    let mut c = client.clone().ready().await.unwrap();
    let (resp, mut send) = c.send_request(req, false).unwrap();
    send.send_data(bytes::Bytes::from_static(b"abc"), false)
        .unwrap();
    send.send_data(bytes::Bytes::new(), true).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("no answer")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let got = String::from_utf8_lossy(&got);
    let (_, sent_body) = got.split_once("\r\n\r\n").unwrap();
    assert_eq!(sent_body, "3\r\nabc\r\n0\r\n\r\n", "{got}");
}

/// A HEAD stream the gateway answers itself (401, 429) gets headers only: HEADERS that end
/// the stream, as for a HEAD the upstream answers (RFC 9110 §9.3.2: a HEAD answer has no
/// content). (Before, the gateway sent its problem JSON in a DATA frame after them, which an
/// HTTP/2 client must take for a protocol error: curl lost the 429 and its `Retry-After`.)
#[tokio::test]
async fn a_head_stream_the_gateway_answers_ends_with_its_headers() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 1}\n";
    let tg = start_tls(&up, &pki, body, &[]);
    let client = h2_connect(&tg).await;
    // The upstream's answer to a HEAD, and the key's one unit spent.
    let r = h2_send(&client, h2_request("HEAD", "/widgets", "k1")).await;
    assert_eq!((r.status, r.body.len(), r.remaining()), (200, 0, 0));
    let r = h2_send(&client, h2_request("HEAD", "/widgets", "k1")).await;
    assert_eq!((r.status, r.body.len()), (429, 0));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() > 0);
    assert_eq!(r.header("x-ratelimit-cost"), Some("0"));
    let anonymous = http::Request::builder()
        .method("HEAD")
        .uri("https://localhost/widgets")
        .body(())
        .unwrap();
    let r = h2_send(&client, anonymous).await;
    assert_eq!((r.status, r.body.len()), (401, 0));
    // The connection goes on: a GET on it gets its problem JSON.
    let r = h2_send(&client, h2_request("GET", "/widgets", "k1")).await;
    assert_eq!(r.status, 429);
    let p: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("quota-exceeded"),
        "{p}"
    );
    assert_eq!(up.count("/widgets"), 1);
}

/// The same over a job submission (DESIGN §8): a stream asking for `respond-async` whose
/// body stalls gets its 408 after `body_timeout` as a synchronous stream does, and no job is
/// made. (Before, the submission's own read of the body had no timer over HTTP/2: the stream
/// got no answer at all, and held its connection past `idle_timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_http2_job_body_gets_408() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let body = "rate_limits:\n  default: {cost: 1, window: 24h, max_cost: 1000}\n  endpoints:\n    /reports/generate: {cost: 5, max_in_flight: 2, queue_timeout: 1s, async: {when: prefer, max_request_body: 1KiB}}\n";
    let tg = start_tls_with(&up, &pki, body, &[], "  body_timeout: 1s\n");
    let client = h2_connect(&tg).await;
    let headers = [("x-api-key", "staller"), ("prefer", "respond-async")];
    let (resp, send) = h2_unfinished_post(&client, "/reports/generate", &headers, b"abc").await;
    let stalled_at = Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("no answer to the stalled job stream within 10 s (body_timeout 1s)")
        .unwrap();
    let after = stalled_at.elapsed();
    assert_eq!(resp.status(), 408);
    assert!(after < Duration::from_secs(8), "answered after {after:?}");
    let (parts, mut body) = resp.into_parts();
    assert_eq!(
        parts.headers.get("content-type").unwrap(),
        "application/problem+json"
    );
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let p: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("request-timeout"),
        "{p}"
    );
    assert_metric(&tg.gw, "tollgate_client_timeouts_total{kind=\"body\"}", 1.0).await;
    // No job, nothing charged: the key's next request finds its budget whole but for itself.
    let r = h2_send(&client, h2_request("GET", "/widgets", "staller")).await;
    assert_eq!((r.status, r.remaining()), (200, 999));
    assert_eq!(up.count("/reports/generate"), 0);
    drop(send);
}

/// README `server.header_timeout`: "the whole request head must arrive within this (from
/// accept); a TLS handshake must finish within it too" (DESIGN §1, slowloris). The handshake's
/// time counts against the head's deadline, not beside it: a client that took 2 s to handshake
/// and 2 s more to send its head (4 s after accept, header_timeout 3 s) was served, over
/// HTTP/1.1 and HTTP/2 alike, so a slow client held a connection almost twice header_timeout.
/// (Each step is a second from the deadline it must meet or miss, either way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_timeout_counts_from_accept_across_the_tls_handshake() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tg = start_tls_with(&up, &pki, INCIDENT, &[], "  header_timeout: 3s\n");
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let head = b"GET /widgets HTTP/1.1\r\nHost: localhost\r\nX-API-Key: slow\r\n\r\n".to_vec();
    for (alpn, first) in [(&b"http/1.1"[..], head), (&b"h2"[..], preface)] {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", tg.tls_port))
            .await
            .unwrap();
        let accepted = Instant::now();
        tokio::time::sleep(Duration::from_millis(2000)).await;
        let mut tls = tls_over(tcp, &tg.roots, &[alpn]).await;
        tokio::time::sleep_until((accepted + Duration::from_millis(4000)).into()).await;
        // Closed by now: the write may fail, the read ends.
        let _ = tls.write_all(&first).await;
        let _ = tls.flush().await;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let closed = loop {
            match tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => break false,
            }
        };
        let (text, alpn) = (String::from_utf8_lossy(&got), String::from_utf8_lossy(alpn));
        assert!(
            closed,
            "{alpn}: still open 5 s after its head was late; got {text:?}"
        );
        assert!(!text.contains("HTTP/1.1 200"), "{alpn}: served: {text:?}");
    }
    assert_eq!(up.count("/widgets"), 0);
    assert_metric(
        &tg.gw,
        "tollgate_client_timeouts_total{kind=\"header\"}",
        2.0,
    )
    .await;
}
