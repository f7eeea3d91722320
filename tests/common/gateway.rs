//! The gateway under test: its process, its CLI, its log and its admin listener (metrics).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{free_port, signal_pid, wait_for_own_ports};
use super::upstream::Upstream;
use super::wait::eventually;

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
    /// `server.threads` (2 unless a test needs every request on one worker thread).
    pub threads: usize,
    pub env: Vec<(&'a str, String)>,
    pub grace: &'a str,
    pub args: Vec<&'a str>,
    /// A command the gateway runs under, e.g. `["prlimit", "--nofile=64:64", "--"]` (it
    /// must exec the gateway, so that the child's pid is the gateway's).
    pub wrapper: Vec<&'a str>,
    /// A second proxy address, `127.0.0.1:<port>` (`server.listen` as a list).
    pub also_listen: Option<u16>,
    /// `--log-format` (`json` unless a test reads the pretty lines).
    pub log_format: &'a str,
}

impl Default for GatewayOpts<'_> {
    fn default() -> Self {
        GatewayOpts {
            upstream_url: String::new(),
            body: "",
            upstream_extra: "",
            server_extra: "",
            threads: 2,
            env: vec![],
            grace: "2s",
            args: vec![],
            wrapper: vec![],
            also_listen: None,
            log_format: "json",
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

    /// As [`Gateway::start`], with `server.grace_period: grace` (for SIGTERM tests).
    pub fn start_with_grace(upstream: &Upstream, body: &str, grace: &str) -> Gateway {
        Self::start_opts(GatewayOpts {
            upstream_url: upstream.url(),
            body,
            grace,
            ..GatewayOpts::default()
        })
    }

    pub fn start_opts(o: GatewayOpts<'_>) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        for _attempt in 0..5 {
            let port = free_port();
            let admin_port = free_port();
            let listen = match o.also_listen {
                Some(p) => format!("[\"127.0.0.1:{port}\", \"127.0.0.1:{p}\"]"),
                None => format!("\"127.0.0.1:{port}\""),
            };
            let yaml = format!(
                "server:\n  listen: {listen}\n  admin_listen: \"127.0.0.1:{admin_port}\"\n  threads: {threads}\n  grace_period: {grace}\n{server_extra}upstream:\n  url: \"{url}\"\n  connect_timeout: 1s\n{extra}\n{body}\n",
                threads = o.threads,
                grace = o.grace,
                server_extra = o.server_extra,
                url = o.upstream_url,
                extra = o.upstream_extra,
                body = o.body
            );
            let yaml = with_forced_slices(yaml);
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
                .args(["--log-format", o.log_format])
                .args(&o.args)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log);
            for (k, v) in &o.env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().unwrap();
            // Read from /proc, not probed with a connect: a probe connection would count against
            // `max_connections` until the gateway had accepted and closed it (tests/tls).
            let ports: Vec<u16> = [port, admin_port]
                .into_iter()
                .chain(o.also_listen)
                .collect();
            let up = wait_for_own_ports(&mut child, &ports, Duration::from_secs(15));
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
        signal_pid(self.pid(), sig);
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
        eventually(Duration::from_secs(3), async || {
            let log = self.log();
            match log.contains(needle) {
                true => Ok(()),
                false => Err(format!("`{needle}` never appeared in the log:\n{log}")),
            }
        })
        .await
    }

    /// Access-log events (JSON lines with target tollgate::access).
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "tollgate::access")
            .collect()
    }

    /// The access events `keep` selects, once there are at least `n` of them (within 10 s). A
    /// request's event is written by the log's writer thread just after its response, so a read
    /// right after the response, or after a metric moved, can come before it.
    pub async fn wait_access(
        &self,
        n: usize,
        keep: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        eventually(Duration::from_secs(10), async || {
            let events: Vec<_> = self.access_log().into_iter().filter(|e| keep(e)).collect();
            match events.len() >= n {
                true => Ok(events),
                false => Err(format!(
                    "{} access events of {n} in:\n{}",
                    events.len(),
                    self.log()
                )),
            }
        })
        .await
    }

    /// Rewrites `from` as `to` in the gateway's config file (for a reload to read); `from`
    /// must be there, so that a test cannot reload an unchanged file by mistake.
    pub fn edit_config(&self, from: &str, to: &str) {
        let yaml = std::fs::read_to_string(&self.config_path).unwrap();
        assert!(
            yaml.contains(from),
            "`{from}` is not in the config:\n{yaml}"
        );
        std::fs::write(&self.config_path, yaml.replace(from, to)).unwrap();
    }

    /// Sends SIGHUP and waits until the reload it caused is counted (`done_before` reloads
    /// were counted before it; signals sent faster would be merged into fewer reloads).
    pub async fn reload(&self, done_before: f64) {
        self.signal("HUP");
        let series = "tollgate_config_reloads_total{result=\"ok\"}";
        wait_metric_at_least(self, series, done_before + 1.0).await
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `tollgate <args> -c <config>`, which must succeed; its stdout.
/// `TOLLGATE_TEST_SLICES=1` runs every Redis-backed gateway of the suite with budget slices
/// (`store.slices: true` wherever a config does not set `slices` itself): the check that every
/// fleet guarantee also holds with slices on, before they could be the default.
fn with_forced_slices(yaml: String) -> String {
    const REDIS: &str = "\n  backend: redis\n";
    if std::env::var("TOLLGATE_TEST_SLICES").as_deref() != Ok("1")
        || !yaml.contains(REDIS)
        || yaml.contains("\n  slices:")
    {
        return yaml;
    }
    yaml.replacen(REDIS, "\n  backend: redis\n  slices: true\n", 1)
}

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

/// A gateway's log lines at level ERROR.
pub fn error_lines(gw: &Gateway) -> Vec<String> {
    gw.log()
        .lines()
        .filter(|l| l.contains("\"level\":\"ERROR\"") || l.contains(" ERROR "))
        .map(str::to_string)
        .collect()
}

/// GETs `path` on the gateway's admin listener: the answer's text.
pub async fn admin_text(gw: &Gateway, path: &str) -> String {
    reqwest::get(gw.admin(path))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
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

/// The budget a registry key has left, from the admin API (`/admin/keys/<id>`).
pub async fn remaining(gw: &Gateway, id: &str) -> u64 {
    let v = admin_json(gw, &format!("/admin/keys/{id}")).await;
    v["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("no remaining for {id}: {v}"))
}

/// Reads a metric sample from Prometheus text: `name{labels}` exactly as exposed. Panics when
/// the series is missing, so that a renamed or absent metric can't pass for a zero.
pub async fn metric(gw: &Gateway, series: &str) -> f64 {
    let text = admin_text(gw, "/metrics").await;
    sample(&text, series).unwrap_or_else(|| panic!("no series `{series}` in /metrics:\n{text}"))
}

/// The value of `series` in a Prometheus text, if it is there.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    })
}

/// Asserts that a metric series reaches `want`. Polls for a while: a request's metrics are
/// recorded in Pingora's logging phase, just after its response has been sent.
pub async fn assert_metric(gw: &Gateway, series: &str, want: f64) {
    wait_metric(gw, series, want, Duration::from_secs(3)).await
}

/// Waits until `gw` runs nothing on `route` (`tollgate_in_flight{route}` at 0): its slots are
/// free. A response reaching the client, or the upstream's count dropping, comes before that:
/// the gateway frees a request's slots in its logging phase, after a store call.
pub async fn wait_idle(gw: &Gateway, route: &str) {
    wait_in_flight(gw, route, 0).await
}

/// Waits until `gw` counts `n` requests in flight on `route` (within 10 s). A request is
/// counted once admitted, before `max_delay` holds it.
pub async fn wait_in_flight(gw: &Gateway, route: &str, n: u64) {
    let series = format!("tollgate_in_flight{{route=\"{route}\"}}");
    wait_metric(gw, &series, n as f64, Duration::from_secs(10)).await
}

/// Waits (10 s at most) until `gw` reports `n` requests waiting on `route`.
pub async fn wait_queued(gw: &Gateway, route: &str, n: f64) {
    let series = format!("tollgate_queued{{route=\"{route}\"}}");
    wait_metric(gw, &series, n, Duration::from_secs(10)).await
}

/// Polls a metric until it equals `want` (within `within`), for counts that take a while. A
/// series not there yet is waited for too: a route's first request makes its series in
/// `logging`, which may run just after the client has its answer.
pub async fn wait_metric(gw: &Gateway, series: &str, want: f64, within: Duration) {
    eventually(within, async || {
        match sample(&admin_text(gw, "/metrics").await, series) {
            Some(got) if got == want => Ok(()),
            Some(got) => Err(format!("{series} is {got}, expected {want}")),
            None => Err(format!("no series `{series}` in /metrics yet")),
        }
    })
    .await
}

/// Polls a metric until it is at least `want` (within 10 s), for counts that others may raise
/// further meanwhile.
pub async fn wait_metric_at_least(gw: &Gateway, series: &str, want: f64) {
    eventually(Duration::from_secs(10), async || {
        match sample(&admin_text(gw, "/metrics").await, series) {
            Some(got) if got >= want => Ok(()),
            Some(got) => Err(format!("{series} is {got}, expected at least {want}")),
            None => Err(format!("no series `{series}` in /metrics yet")),
        }
    })
    .await
}
