//! A single `redis-server`, and the names of tollgate's keys in it (the gateway's own
//! layout, `tollgate::store::redis::keys`, by API key rather than by its hash).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tollgate::identity::hash_key;
use tollgate::store::redis::keys;

use super::process::{free_port, signal_pid, wait_for_port};
use super::wait::eventually;

/// A `redis-server` on a free port, without persistence.
pub struct Redis {
    pub port: u16,
    pub(super) child: Option<Child>,
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
        cli_on(self.port, args)
    }

    /// EVALSHA calls this Redis has run so far (`INFO commandstats`).
    pub fn evalsha_calls(&self) -> u64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find_map(|l| {
                let rest = l.strip_prefix("cmdstat_evalsha:calls=")?;
                rest.split(',').next()?.parse().ok()
            })
            .unwrap_or(0)
    }

    /// Waits until `redis-cli args` answers `want` (within `within`): for what the gateways
    /// write, and Redis expires, in the background.
    pub async fn wait_cli(&self, args: &[&str], want: &str, within: Duration) {
        eventually(within, async || match self.cli(args) {
            got if got == want => Ok(()),
            got => Err(format!("{args:?} is {got}, not {want}")),
        })
        .await
    }

    /// Waits until `route`'s fleet-wide slots held in Redis number `n` (within `within`):
    /// releases and renewals reach Redis in the background.
    pub async fn wait_route_slots(&self, route: &str, n: usize, within: Duration) {
        let key = redis_route_slots_key(route);
        self.wait_cli(&["ZCARD", &key], &n.to_string(), within)
            .await
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

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

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The Redis key of an API key's budget.
pub fn redis_budget_key(api_key: &str) -> String {
    keys::budget_key(&hash_key(api_key.as_bytes()))
}

/// The Redis key of the budget slices instances hold of an API key.
pub fn redis_holds_key(api_key: &str) -> String {
    keys::holds_key(&hash_key(api_key.as_bytes()))
}

/// The Redis key of a route's in-flight lease set.
pub fn redis_route_slots_key(route: &str) -> String {
    keys::route_slots_key(route)
}

/// The Redis key of a capped route's fair-queue state (a hash: `r:<key tag>` requests a key
/// runs, `l:<lease>` a lease's key, `i:<instance>` an instance's beat).
pub fn redis_route_queue_state_key(route: &str) -> String {
    keys::route_queue_state_key(route)
}

/// An API key's tag, as Redis keys and a route's queue state name it.
pub fn redis_key_tag(api_key: &str) -> String {
    keys::key_tag(&hash_key(api_key.as_bytes()))
}

/// The Redis key of an async job's record.
pub fn redis_job_key(id: &str) -> String {
    keys::job_key(id)
}

pub(super) fn cli_on(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
