//! Processes and ports: the child processes a test starts (killed on drop), free loopback
//! ports, and a runtime of the harness's own for the servers it runs in-process.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

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

pub(super) fn wait_for_port(port: u16, timeout: Duration) -> bool {
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
pub fn listens_on(pid: u32, port: u16) -> bool {
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
pub(super) fn wait_for_own_ports(
    child: &mut std::process::Child,
    ports: &[u16],
    timeout: Duration,
) -> bool {
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
pub(super) struct BackgroundRuntime(Option<tokio::runtime::Runtime>);

impl BackgroundRuntime {
    pub(super) fn new(threads: usize) -> BackgroundRuntime {
        BackgroundRuntime(Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
                .unwrap(),
        ))
    }

    /// Binds a free loopback port and runs `serve` on the listener.
    pub(super) fn serve<F, Fut>(&self, serve: F) -> u16
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

pub(super) fn signal_pid(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}
