//! The upstream: the sample API in-process, over plain HTTP or behind TLS.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::sample_api::{PathStats, SampleApi};

use super::pki::Pki;
use super::process::BackgroundRuntime;
use super::wait::eventually;

/// The sample API on its own runtime thread.
pub struct Upstream {
    pub api: Arc<SampleApi>,
    pub port: u16,
    _rt: BackgroundRuntime,
}

impl Upstream {
    pub fn start(report_time: Duration) -> Upstream {
        let rt = BackgroundRuntime::new(2);
        let api = SampleApi::new(report_time);
        let a = api.clone();
        let port = rt.serve(move |l| tollgate::sample_api::serve(l, a));
        Upstream { api, port, _rt: rt }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn stats(&self) -> BTreeMap<String, PathStats> {
        self.api.stats()
    }

    pub fn count(&self, path: &str) -> u64 {
        self.stats().get(path).map(|s| s.count).unwrap_or(0)
    }

    /// Waits until the upstream is handling `n` requests to `path` at once (so a test knows
    /// its requests were admitted, instead of guessing with a sleep).
    pub async fn wait_current(&self, path: &str, n: u64) {
        eventually(Duration::from_secs(10), async || {
            match self.stats().get(path).map(|s| s.current).unwrap_or(0) {
                current if current >= n => Ok(()),
                current => Err(format!("upstream has {current} of {n} on {path}")),
            }
        })
        .await
    }

    /// The `X-API-Key` of each request for `path` (whatever its query), in the order they
    /// arrived.
    pub fn keys_in_order(&self, path: &str) -> Vec<String> {
        self.api
            .seen()
            .into_iter()
            .filter(|s| s.target.split('?').next() == Some(path))
            .map(|s| s.header("x-api-key")[0].to_string())
            .collect()
    }

    /// The requests whose target starts with `prefix`, in the order they were recorded.
    pub fn seen_on(&self, prefix: &str) -> Vec<tollgate::sample_api::Seen> {
        self.api
            .seen()
            .into_iter()
            .filter(|s| s.target.starts_with(prefix))
            .collect()
    }

    /// When each request whose target starts with `prefix` arrived, earliest first (for
    /// spacing measured where the work is, not by the test's clock). Sorted: two requests
    /// arriving at once may be recorded in either order.
    pub fn arrivals(&self, prefix: &str) -> Vec<Instant> {
        let mut at: Vec<Instant> = self.seen_on(prefix).into_iter().map(|s| s.at).collect();
        at.sort();
        at
    }

    pub fn max_concurrent(&self, path: &str) -> u64 {
        self.stats()
            .get(path)
            .map(|s| s.max_concurrent)
            .unwrap_or(0)
    }
}

/// The sample API behind TLS, with a certificate for `localhost` from a CA of its own.
pub struct TlsUpstream {
    pub api: Arc<SampleApi>,
    pub port: u16,
    pub ca_file: PathBuf,
    /// SNI names the server was sent, one per connection.
    pub sni: Arc<std::sync::Mutex<Vec<Option<String>>>>,
    _dir: tempfile::TempDir,
    _rt: BackgroundRuntime,
}

impl TlsUpstream {
    pub fn start() -> TlsUpstream {
        use tokio_rustls::rustls;
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new(dir.path());
        let ca_file = pki.ca_file.clone();
        let key = rustls::pki_types::PrivateKeyDer::try_from(pki.key_der).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![pki.cert_der.into()], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

        let rt = BackgroundRuntime::new(1);
        let api = SampleApi::new(Duration::ZERO);
        let sni = Arc::new(std::sync::Mutex::new(vec![]));
        let (a, s) = (api.clone(), sni.clone());
        let port = rt.serve(move |l| async move {
            loop {
                let Ok((tcp, _)) = l.accept().await else {
                    continue;
                };
                let (acceptor, a, s) = (acceptor.clone(), a.clone(), s.clone());
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        s.lock()
                            .unwrap()
                            .push(tls.get_ref().1.server_name().map(str::to_string));
                        tollgate::sample_api::serve_connection(tls, a).await;
                    }
                });
            }
        });
        TlsUpstream {
            api,
            port,
            ca_file,
            sni,
            _dir: dir,
            _rt: rt,
        }
    }
}

/// An upstream that reads each request's head and then, after `after`, closes its connection
/// without a byte of answer — except for targets starting with `/ok`, answered `200 ok` on a
/// kept-alive connection, and `/stale`, answered so as the first request of a connection and,
/// as a later one, closed the moment it arrives, unread and unanswered (a kept-alive
/// connection the upstream gave up on as the request came: the kernel resets a connection
/// closed with unread data, as it does one whose request arrives after the close). It records
/// every request it saw: its target, and which connection (counted from 1) and which request
/// on that connection (counted from 1) it came on.
pub struct HangUp {
    pub port: u16,
    seen: Arc<std::sync::Mutex<Vec<(String, usize, usize)>>>,
}

impl HangUp {
    pub fn start(after: Duration) -> HangUp {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        // The thread ends with the test process; it only serves this test's gateway.
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { continue };
                let log = log.clone();
                std::thread::spawn(move || {
                    for nth in 1.. {
                        if nth > 1 {
                            // A later `/stale` is seen without being read, and the
                            // connection closed with it unread.
                            let mut peeked = [0u8; 256];
                            let target = loop {
                                let Ok(n) = conn.peek(&mut peeked) else {
                                    return;
                                };
                                if n == 0 {
                                    return;
                                }
                                let seen = String::from_utf8_lossy(&peeked[..n]).into_owned();
                                if let Some((line, _)) = seen.split_once("\r\n") {
                                    break line.split(' ').nth(1).unwrap_or("").to_string();
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            };
                            if target.starts_with("/stale") {
                                log.lock().unwrap().push((target, n + 1, nth));
                                return;
                            }
                        }
                        let mut head = Vec::new();
                        let mut byte = [0u8; 1];
                        while !head.ends_with(b"\r\n\r\n") {
                            match conn.read(&mut byte) {
                                Ok(1) => head.push(byte[0]),
                                _ => return,
                            }
                        }
                        let head = String::from_utf8_lossy(&head).into_owned();
                        let target = head.split(' ').nth(1).unwrap_or("").to_string();
                        log.lock().unwrap().push((target.clone(), n + 1, nth));
                        let stale = target.starts_with("/stale");
                        if !target.starts_with("/ok") && !stale {
                            std::thread::sleep(after);
                            return; // dropped: closed, nothing answered
                        }
                        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if conn.write_all(ok).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        HangUp { port, seen }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Each request read whose target starts with `prefix`: (target, connection, request on it).
    pub fn seen(&self, prefix: &str) -> Vec<(String, usize, usize)> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(t, _, _)| t.starts_with(prefix))
            .cloned()
            .collect()
    }
}
