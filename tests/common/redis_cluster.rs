//! A Redis Cluster the test creates, kills nodes of and watches fail over.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use super::process::free_port;
use super::redis_server::{cli_on, Redis};

/// A free port whose cluster bus port (+10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let p = free_port();
        if p < 55_000 && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
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
