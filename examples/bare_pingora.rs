//! The bare Pingora floor for `bench/run.sh` (letter g): an empty `ProxyHttp` that only picks
//! the upstream, built with the same Pingora, allocator and runtime settings as tollgate, so
//! that the bench can say how much of Pingora's throughput tollgate's own work costs.
//!
//! `cargo build --release --example bare_pingora`, then
//! `bare_pingora LISTEN_ADDR UPSTREAM_ADDR` (e.g. `127.0.0.1:8081 127.0.0.1:8082`, plain HTTP).
//! It logs nothing (no logger is installed, so Pingora's `log` calls are no-ops) and stops on
//! SIGTERM/SIGINT through Pingora's own signal handling. Deliberately independent of the
//! `tollgate` library: nothing of tollgate's may run here.

use std::net::SocketAddr;
use std::process::ExitCode;

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::upstreams::peer::HttpPeer;

/// As in tollgate's main.rs: the allocator is part of the floor being measured.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

struct Bare {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    /// Pingora's defaults otherwise: upstream keep-alive through its connection pool, no
    /// timeouts, the client's request forwarded unchanged.
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (listen, upstream) = match args.as_slice() {
        [_, listen, upstream] => match upstream.parse::<SocketAddr>() {
            Ok(u) => (listen.clone(), u),
            Err(e) => {
                eprintln!("bare_pingora: upstream {upstream}: {e}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: bare_pingora LISTEN_ADDR UPSTREAM_ADDR");
            return ExitCode::from(2);
        }
    };
    // Per-process paths: Pingora's defaults are fixed /tmp names that two instances would share.
    let tmp = std::env::temp_dir();
    let tag = std::process::id();
    let conf = ServerConf {
        threads: 1,
        // tollgate's setting: one current-thread runtime per worker.
        work_stealing: false,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        pid_file: tmp
            .join(format!("bare-pingora-{tag}.pid"))
            .display()
            .to_string(),
        upgrade_sock: tmp
            .join(format!("bare-pingora-{tag}.sock"))
            .display()
            .to_string(),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(&server.configuration, Bare { upstream });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever()
}
