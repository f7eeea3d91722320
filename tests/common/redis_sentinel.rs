//! A Sentinel-managed primary and replica.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{free_port, wait_for_port};
use super::redis_server::Redis;
use super::wait::eventually;

/// A Sentinel (quorum 1, `down-after-milliseconds 500`, `failover-timeout 2000`) of its own
/// config file in `dir`, watching master `tollgate` at `primary`, with `extra` config lines.
pub fn start_sentinel(dir: &std::path::Path, primary: u16, extra: &str) -> Redis {
    let port = free_port();
    let conf = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\nsentinel monitor tollgate 127.0.0.1 {primary} 1\nsentinel down-after-milliseconds tollgate 500\nsentinel failover-timeout tollgate 2000\n{extra}",
            dir = dir.display(),
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
    Redis {
        port,
        child: Some(child),
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
        // Its config at epoch 3, as after three failovers: a Sentinel with an older config
        // (`start_sentinel` with none) is one that has not caught up.
        let auth = password
            .map(|pw| format!("sentinel auth-pass tollgate {pw}\n"))
            .unwrap_or_default();
        let sentinel = start_sentinel(
            dir.path(),
            primary.port,
            &format!("sentinel config-epoch tollgate 3\n{auth}"),
        );
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

    /// Waits until `n` clients listen to the Sentinel's channels (each gateway's failover
    /// watcher): a failover started before a watcher listens is one it cannot follow as it
    /// happens, and a gateway that starts under load may take a while to subscribe.
    pub async fn wait_watchers(&self, n: usize) {
        eventually(Duration::from_secs(10), async || {
            let listening = self
                .sentinel
                .cli(&["CLIENT", "LIST"])
                .lines()
                .filter(|l| l.contains(" flags=P ") && !l.contains(" sub=0 "))
                .count();
            match listening >= n {
                true => Ok(()),
                false => Err(format!(
                    "{listening} of {n} watchers listen to the Sentinel"
                )),
            }
        })
        .await
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
