//! Test harness: the real gateway binary, a real HTTP upstream (the sample API, in-process) and
//! real `redis-server` processes, each on free loopback ports and stopped on drop.
#![allow(dead_code)]

pub mod otlp;

use std::collections::BTreeMap;
use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::sample_api::{PathStats, SampleApi};

/// Kills a child process when dropped, so a failing assertion leaves nothing running.
pub struct Reap(pub Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_port(port: u16, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// True when process `pid` itself listens on `port` (Linux: its socket inodes against
/// `/proc/net/tcp`). A connect alone can reach another process: `free_port` hands out a port
/// that a test running in parallel may be handed too, and whichever binds second exits.
fn listens_on(pid: u32, port: u16) -> bool {
    // Inodes of the sockets listening (state 0A) on `port`: fields 1 (local address:port, hex),
    // 3 (state) and 9 (inode) of each line.
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(table) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in table.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(&"0A"), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let local_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) {
                inodes.insert(inode.to_string());
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .any(|i| inodes.contains(&i))
}

/// Waits until `child` listens on every one of `ports` itself; false if it exits first (a
/// port clash) or `timeout` passes.
fn wait_for_own_ports(child: &mut std::process::Child, ports: &[u16], timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        if ports.iter().all(|p| listens_on(child.id(), *p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A tokio runtime of the harness's own, for servers the test talks to. Tests drop it inside
/// their own runtime, where a blocking shutdown would panic: it shuts down in the background.
struct BackgroundRuntime(Option<tokio::runtime::Runtime>);

impl BackgroundRuntime {
    fn new(threads: usize) -> BackgroundRuntime {
        BackgroundRuntime(Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
                .unwrap(),
        ))
    }

    /// Binds a free loopback port and runs `serve` on the listener.
    fn serve<F, Fut>(&self, serve: F) -> u16
    where
        F: FnOnce(tokio::net::TcpListener) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let std_l = TcpListener::bind("127.0.0.1:0").unwrap();
        std_l.set_nonblocking(true).unwrap();
        let port = std_l.local_addr().unwrap().port();
        if let Some(rt) = &self.0 {
            rt.spawn(async move { serve(tokio::net::TcpListener::from_std(std_l).unwrap()).await });
        }
        port
    }
}

impl Drop for BackgroundRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

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
        let start = Instant::now();
        while self.stats().get(path).map(|s| s.current).unwrap_or(0) < n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "upstream never saw {n} on {path}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn max_concurrent(&self, path: &str) -> u64 {
        self.stats()
            .get(path)
            .map(|s| s.max_concurrent)
            .unwrap_or(0)
    }
}

/// A CA of the test's own and a certificate for `localhost` signed by it, written as PEM files.
pub struct Pki {
    pub ca_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub cert_der: Vec<u8>,
    pub key_der: Vec<u8>,
}

impl Pki {
    pub fn new(dir: &std::path::Path) -> Pki {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tollgate test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let pki = Pki {
            ca_file: dir.join("ca.pem"),
            cert_file: dir.join("cert.pem"),
            key_file: dir.join("key.pem"),
            cert_der: leaf.der().to_vec(),
            key_der: leaf_key.serialize_der(),
        };
        std::fs::write(&pki.ca_file, ca_cert.pem()).unwrap();
        std::fs::write(&pki.cert_file, leaf.pem()).unwrap();
        std::fs::write(&pki.key_file, leaf_key.serialize_pem()).unwrap();
        pki
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

/// A `redis-server` on a free port, without persistence.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Redis {
        Self::start_with(port, &[])
    }

    /// With extra arguments, e.g. `--requirepass` or TLS settings (then `port` is the TLS port).
    pub fn start_with(port: u16, extra: &[&str]) -> Redis {
        let plain_port = if extra.contains(&"--tls-port") {
            "0".to_string()
        } else {
            port.to_string()
        };
        let child = Command::new("redis-server")
            .args([
                "--port",
                &plain_port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        assert!(
            wait_for_port(port, Duration::from_secs(10)),
            "redis did not start"
        );
        Redis {
            port,
            child: Some(child),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A gateway process built from a YAML body (everything but `server`/`upstream`, which the
/// harness fills in with free ports unless the body brings its own `upstream`).
pub struct Gateway {
    pub port: u16,
    pub admin_port: u16,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    child: Option<Child>,
}

pub struct GatewayOpts<'a> {
    pub upstream_url: String,
    pub body: &'a str,
    pub upstream_extra: &'a str,
    /// More `server:` lines (indented), e.g. `"  header_timeout: 1s\n"`.
    pub server_extra: &'a str,
    pub env: Vec<(&'a str, String)>,
    pub grace: &'a str,
    pub args: Vec<&'a str>,
    /// A command the gateway runs under, e.g. `["prlimit", "--nofile=64:64", "--"]` (it
    /// must exec the gateway, so that the child's pid is the gateway's).
    pub wrapper: Vec<&'a str>,
}

impl Default for GatewayOpts<'_> {
    fn default() -> Self {
        GatewayOpts {
            upstream_url: String::new(),
            body: "",
            upstream_extra: "",
            server_extra: "",
            env: vec![],
            grace: "2s",
            args: vec![],
            wrapper: vec![],
        }
    }
}

impl Gateway {
    pub fn start(upstream: &Upstream, body: &str) -> Gateway {
        Self::start_opts(GatewayOpts {
            upstream_url: upstream.url(),
            body,
            ..GatewayOpts::default()
        })
    }

    pub fn start_opts(o: GatewayOpts<'_>) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        for _attempt in 0..5 {
            let port = free_port();
            let admin_port = free_port();
            let yaml = format!(
                "server:\n  listen: \"127.0.0.1:{port}\"\n  admin_listen: \"127.0.0.1:{admin_port}\"\n  threads: 2\n  grace_period: {grace}\n{server_extra}upstream:\n  url: \"{url}\"\n  connect_timeout: 1s\n{extra}\n{body}\n",
                grace = o.grace,
                server_extra = o.server_extra,
                url = o.upstream_url,
                extra = o.upstream_extra,
                body = o.body
            );
            let config_path = dir.path().join("gateway.yaml");
            std::fs::write(&config_path, yaml).unwrap();
            let log = std::fs::File::create(dir.path().join("gateway.log")).unwrap();
            let mut cmd = match o.wrapper.split_first() {
                Some((program, args)) => {
                    let mut c = Command::new(program);
                    c.args(args).arg(env!("CARGO_BIN_EXE_tollgate"));
                    c
                }
                None => Command::new(env!("CARGO_BIN_EXE_tollgate")),
            };
            cmd.args(["run", "-c"])
                .arg(&config_path)
                .args(["--log-format", "json"])
                .args(&o.args)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log);
            for (k, v) in &o.env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().unwrap();
            let up = wait_for_own_ports(&mut child, &[port, admin_port], Duration::from_secs(15))
                && wait_for_port(port, Duration::from_secs(5));
            if up {
                return Gateway {
                    port,
                    admin_port,
                    config_path,
                    dir,
                    child: Some(child),
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let mut log = String::new();
        let _ = std::fs::File::open(dir.path().join("gateway.log"))
            .and_then(|mut f| f.read_to_string(&mut log));
        panic!("gateway did not start:\n{log}");
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn admin(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.admin_port, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// Waits for the process to exit; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let start = Instant::now();
        let child = self.child.as_mut()?;
        while start.elapsed() < timeout {
            if let Ok(Some(st)) = child.try_wait() {
                self.child = None;
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gateway.log")).unwrap_or_default()
    }

    /// Waits until the log contains `needle` (lines are written by a background thread).
    pub async fn wait_log(&self, needle: &str) {
        let start = Instant::now();
        while !self.log().contains(needle) {
            assert!(
                start.elapsed() < Duration::from_secs(3),
                "`{needle}` never appeared in the log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Access-log events (JSON lines with target tollgate::access).
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "tollgate::access")
            .collect()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `tollgate <args> -c <config>`, which must succeed; its stdout.
pub fn cli_ok(config: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .arg("-c")
        .arg(config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `tollgate check` on `yaml`, which must fail: its output (stdout and stderr).
pub fn check_fails(yaml: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(60))
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

/// GETs `path` on the gateway's admin listener and parses the JSON answer.
pub async fn admin_json(gw: &Gateway, path: &str) -> serde_json::Value {
    reqwest::get(gw.admin(path))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Reads a metric sample from Prometheus text: `name{labels}` exactly as exposed. Panics when
/// the series is missing, so that a renamed or absent metric can't pass for a zero.
pub async fn metric(gw: &Gateway, series: &str) -> f64 {
    let text = reqwest::get(gw.admin("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or_else(|| panic!("no series `{series}` in /metrics:\n{text}"))
}

/// Asserts that a metric series reaches `want`. Polls for a while: a request's metrics are
/// recorded in Pingora's logging phase, just after its response has been sent.
pub async fn assert_metric(gw: &Gateway, series: &str, want: f64) {
    wait_metric(gw, series, want, Duration::from_secs(3)).await
}

/// Polls a metric until it equals `want` (within `within`), for counts that take a while.
pub async fn wait_metric(gw: &Gateway, series: &str, want: f64, within: Duration) {
    let start = Instant::now();
    loop {
        let got = metric(gw, series).await;
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{series} is {got}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn sha256_hex(key: &str) -> String {
    hex::encode(tollgate::identity::hash_key(key.as_bytes()))
}

/// The incident's rate limits with `/reports/generate` costing 1 and carrying `caps`
/// (indented endpoint lines, e.g. `"      max_in_flight: 2\n"`): for in-flight tests.
pub fn incident_with_report_caps(caps: &str) -> String {
    INCIDENT.replace("      cost: 20\n", &format!("      cost: 1\n{caps}"))
}

pub const INCIDENT: &str = r#"rate_limits:
  default:
    cost: 1
    window: 60s
    max_cost: 120
    max_delay: 0s
  endpoints:
    /reports/generate:
      cost: 20
    /exports/bulk:
      cost: 15
    /analytics/query:
      cost: 10
    "GET /reports/{id}":
      cost: 1
"#;

/// A response read off a raw socket (for requests no HTTP client library would send).
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for RawResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &String::from_utf8_lossy(&self.body))
            .finish()
    }
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// Whether this is a problem JSON whose `type` ends in `kind`.
    pub fn is_problem(&self, kind: &str) -> bool {
        self.header("content-type") == Some("application/problem+json")
            && self.json()["type"]
                .as_str()
                .is_some_and(|t| t.ends_with(kind))
    }
}

/// Connects to the gateway's proxy port, with a read timeout so that a test never hangs.
pub fn raw_connect(port: u16) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Sends `request` byte for byte on a new connection and reads one response. `None` when the
/// server closed the connection without answering.
pub fn raw_request(port: u16, request: &[u8]) -> Option<RawResponse> {
    use std::io::Write;
    let mut s = raw_connect(port);
    s.write_all(request).unwrap();
    read_raw_response(&mut s)
}

/// Reads one HTTP/1.1 response (Content-Length, chunked, or until close).
pub fn read_raw_response(s: &mut std::net::TcpStream) -> Option<RawResponse> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = buf[head_end + 4..].to_vec();
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut read_more = |body: &mut Vec<u8>| match s.read(&mut chunk) {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            body.extend_from_slice(&chunk[..n]);
            true
        }
    };
    if let Some(len) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len && read_more(&mut body) {}
        body.truncate(len);
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        while !body.windows(5).any(|w| w == b"0\r\n\r\n") && read_more(&mut body) {}
        body = dechunk(&body);
    } else {
        while read_more(&mut body) {}
    }
    Some(RawResponse {
        status,
        headers,
        body,
    })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..i])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok())
            .unwrap_or(0);
        b = &b[i + 2..];
        if size == 0 || b.len() < size {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or_default();
    }
    out
}

/// Whether the server has closed `s` (EOF or reset) — without waiting: bytes already sent to
/// us (a 408, say) are read and skipped.
pub fn is_closed(s: &mut std::net::TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut chunk = [0u8; 4096];
    let closed = loop {
        match s.read(&mut chunk) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    s.set_nonblocking(false).unwrap();
    closed
}

/// A gateway's log lines at level ERROR.
pub fn error_lines(gw: &Gateway) -> Vec<String> {
    gw.log()
        .lines()
        .filter(|l| l.contains("\"level\":\"ERROR\"") || l.contains(" ERROR "))
        .map(str::to_string)
        .collect()
}

impl Redis {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGSTOP: the process stays, its sockets accept and buffer, nothing answers.
    pub fn pause(&self) {
        signal_pid(self.pid(), "STOP");
    }

    /// SIGCONT: answers again, starting with what was buffered meanwhile.
    pub fn resume(&self) {
        signal_pid(self.pid(), "CONT");
    }
}

fn signal_pid(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// The Redis key of an API key's budget (the layout of src/store/redis/keys.rs).
pub fn redis_budget_key(api_key: &str) -> String {
    use base64::Engine;
    let h = tollgate::identity::hash_key(api_key.as_bytes());
    let mut tag = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&h[..8]);
    tag.truncate(10);
    format!("t{{{tag}}}b")
}

/// The Redis key of the budget slices instances hold of an API key (src/store/redis/keys.rs).
pub fn redis_holds_key(api_key: &str) -> String {
    let mut k = redis_budget_key(api_key);
    k.pop();
    k.push('h');
    k
}

/// The Redis key of a route's in-flight lease set (src/store/redis/keys.rs).
pub fn redis_route_slots_key(route: &str) -> String {
    use base64::Engine;
    let h = tollgate::identity::hash_key(route.as_bytes());
    let mut tag = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&h[..8]);
    tag.truncate(10);
    format!("t:r{{{tag}}}f")
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let p = free_port();
        if p < 55_000 && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
}

fn cli_on(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A Redis Cluster made by the test: `primaries` primaries with one replica each
/// (`redis-cli --cluster create … --cluster-replicas 1`), a 1 s node timeout so that a replica
/// takes over a dead primary within seconds.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start(primaries: usize) -> RedisCluster {
        let dir = tempfile::tempdir().unwrap();
        let nodes: Vec<Redis> = (0..primaries * 2)
            .map(|_| Self::start_node(&dir, free_cluster_port()))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, dir };
        cluster.wait_healthy(primaries, Duration::from_secs(20));
        cluster
    }

    fn start_node(dir: &tempfile::TempDir, port: u16) -> Redis {
        let conf = dir.path().join(format!("nodes-{port}.conf"));
        Redis::start_with(
            port,
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                conf.to_str().unwrap(),
                "--cluster-node-timeout",
                "1000",
                // A replica may take over however long its link was down.
                "--cluster-replica-validity-factor",
                "0",
                "--dir",
                dir.path().to_str().unwrap(),
            ],
        )
    }

    /// Starts a killed node again, empty, with its cluster config: it rejoins as a replica
    /// of the primary that took over from it, and syncs from it.
    pub fn restart(&mut self, port: u16) {
        let node = Self::start_node(&self.dir, port);
        *self.nodes.iter_mut().find(|n| n.port == port).unwrap() = node;
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    fn live(&self) -> impl Iterator<Item = &Redis> {
        self.nodes.iter().filter(|n| n.child.is_some())
    }

    /// `redis-cli -c` on a live node: follows MOVED to the key's owner.
    pub fn cli(&self, args: &[&str]) -> String {
        let port = self.live().next().expect("a live node").port;
        cli_on(port, &[&["-c"], args].concat())
    }

    /// Ports of the primaries serving slots now, as a live node sees them.
    pub fn primaries(&self) -> Vec<u16> {
        let nodes = self.cli(&["CLUSTER", "NODES"]);
        let mut ports: Vec<u16> = nodes
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail") && l.split(' ').count() > 8)
            .filter_map(|l| {
                let addr = l.split(' ').nth(1)?;
                addr.split(['@', ':']).nth(1)?.parse().ok()
            })
            .collect();
        ports.sort();
        ports
    }

    /// The port of the primary that owns `key`'s slot.
    pub fn owner(&self, key: &str) -> u16 {
        let slot: u16 = self.cli(&["CLUSTER", "KEYSLOT", key]).parse().unwrap();
        for l in self.cli(&["CLUSTER", "NODES"]).lines() {
            let f: Vec<&str> = l.split(' ').collect();
            if !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let owns = f[8..].iter().any(|r| match r.split_once('-') {
                Some((a, b)) => {
                    (a.parse::<u16>().unwrap_or(u16::MAX)..=b.parse().unwrap_or(0)).contains(&slot)
                }
                None => r.parse::<u16>().ok() == Some(slot),
            });
            if owns {
                return f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no owner for slot {slot}");
    }

    pub fn node(&self, port: u16) -> &Redis {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    pub fn kill(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap()
            .kill();
    }

    /// Waits until a replica took over from the (dead) primary on `port`, and the cluster is
    /// ok again.
    pub fn wait_failover(&self, port: u16, timeout: Duration) {
        let start = Instant::now();
        loop {
            let primaries = self.primaries();
            if !primaries.contains(&port) && primaries.len() == self.nodes.len() / 2 {
                break;
            }
            assert!(start.elapsed() < timeout, "no failover: {primaries:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_healthy(self.nodes.len() / 2, timeout);
    }

    /// Waits until every live node says the cluster is ok with `primaries` primaries.
    pub fn wait_healthy(&self, primaries: usize, timeout: Duration) {
        let start = Instant::now();
        loop {
            let ok = self.live().all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_size:{primaries}"))
            });
            // Replicas in sync: a promoted one has the data.
            let synced = self.live().all(|n| {
                let info = n.cli(&["INFO", "replication"]);
                info.contains("role:master") || info.contains("master_link_status:up")
            });
            if ok && synced && self.primaries().len() == primaries {
                return;
            }
            assert!(start.elapsed() < timeout, "cluster not healthy");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A Sentinel-managed pair: a primary, its replica, one Sentinel (quorum 1,
/// `down-after-milliseconds 500`, `failover-timeout 2000`) watching master `tollgate`.
pub struct SentinelSet {
    pub primary: Redis,
    pub replica: Redis,
    pub sentinel: Redis,
    dir: tempfile::TempDir,
}

impl SentinelSet {
    pub fn start() -> SentinelSet {
        Self::start_with_password(None)
    }

    /// With `password`, the primary and the replica require it (`requirepass`, `masterauth`)
    /// and the Sentinel uses it (`auth-pass`); the Sentinel itself asks for none.
    pub fn start_with_password(password: Option<&str>) -> SentinelSet {
        let dir = tempfile::tempdir().unwrap();
        // A replica's full sync writes an RDB file: into the test's directory.
        let data = dir.path().to_str().unwrap().to_string();
        let auth: Vec<&str> = match password {
            Some(pw) => vec!["--requirepass", pw, "--masterauth", pw],
            None => vec![],
        };
        let primary = Redis::start_with(free_port(), &[&["--dir", &data][..], &auth].concat());
        let primary_port = primary.port.to_string();
        let replica_args = ["--replicaof", "127.0.0.1", &primary_port, "--dir", &data];
        let replica = Redis::start_with(free_port(), &[&replica_args[..], &auth].concat());
        let cli_auth: Vec<&str> = match password {
            Some(pw) => vec!["-a", pw, "--no-auth-warning"],
            None => vec![],
        };
        let start = Instant::now();
        while !replica
            .cli(&[&cli_auth[..], &["INFO", "replication"]].concat())
            .contains("master_link_status:up")
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "replica never synced"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nsentinel monitor tollgate 127.0.0.1 {p} 1\nsentinel down-after-milliseconds tollgate 500\nsentinel failover-timeout tollgate 2000\n{auth}",
                dir = dir.path().display(),
                p = primary.port,
                auth = password
                    .map(|pw| format!("sentinel auth-pass tollgate {pw}\n"))
                    .unwrap_or_default(),
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        assert!(
            wait_for_port(port, Duration::from_secs(10)),
            "sentinel did not start"
        );
        let sentinel = Redis {
            port,
            child: Some(child),
        };
        let set = SentinelSet {
            primary,
            replica,
            sentinel,
            dir,
        };
        // The Sentinel knows the replica (it may then promote it).
        let start = Instant::now();
        while !set
            .sentinel
            .cli(&["SENTINEL", "REPLICAS", "tollgate"])
            .contains(&set.replica.port.to_string())
        {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "sentinel never saw the replica"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        set
    }

    /// `redis+sentinel://` naming a dead Sentinel first: the next one in the list answers.
    pub fn url(&self) -> String {
        format!(
            "redis+sentinel://127.0.0.1:{},127.0.0.1:{}/tollgate",
            free_port(),
            self.sentinel.port
        )
    }

    /// The primary's port as the Sentinel names it.
    pub fn current_primary(&self) -> u16 {
        let out = self
            .sentinel
            .cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "tollgate"]);
        out.lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0)
    }
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

/// A TCP proxy in front of a Redis (or anything): it can blackhole its connections — holding
/// what is sent both ways, which the kernel buffers — and heal them, delivering it all late.
/// One gateway's path to Redis, cut and restored while the others' stays up.
pub struct Proxy {
    pub port: u16,
    open: tokio::sync::watch::Sender<bool>,
    _rt: BackgroundRuntime,
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        let rt = BackgroundRuntime::new(1);
        let (open, watch) = tokio::sync::watch::channel(true);
        let port = rt.serve(move |listener| async move {
            while let Ok((client, _)) = listener.accept().await {
                let watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pump(cr, sw, watch.clone()), pump(sr, cw, watch));
                });
            }
        });
        Proxy {
            port,
            open,
            _rt: rt,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Nothing passes any more (new connections are accepted, then hang the same way).
    pub fn blackhole(&self) {
        self.open.send_replace(false);
    }

    /// Everything held is delivered, and traffic flows again.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }
}

/// Copies `from` to `to`, holding each chunk while the proxy is blackholed.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if open.wait_for(|o| *o).await.is_err() {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
