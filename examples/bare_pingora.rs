//! The bare Pingora floor for `bench/run.sh` (letters g and i): an empty `ProxyHttp` that only picks
//! the upstream, built with the same Pingora, allocator and runtime settings as tollgate, so
//! that the bench can say how much of Pingora's throughput tollgate's own work costs.
//!
//! `cargo build --release --example bare_pingora`, then
//! `bare_pingora LISTEN_ADDR UPSTREAM_ADDR` (e.g. `127.0.0.1:8081 127.0.0.1:8082`, plain HTTP).
//! It logs nothing (no logger is installed, so Pingora's `log` calls are no-ops) and stops on
//! SIGTERM/SIGINT through Pingora's own signal handling. Deliberately independent of the
//! `tollgate` library: nothing of tollgate's may run here.
//!
//! `BARE_PINGORA_HEADERS` adds header work, with fixed values and through Pingora's own header
//! API as tollgate does (bench letter i is `1`):
//! - `1`: the headers tollgate puts on every proxied request: upstream, `Host` replaced and
//!   `X-Forwarded-Host/-For/-Proto` and `X-Request-Id` added (as nginx's (b) adds the first
//!   three); on the response, the six rate-limit headers;
//! - `design`: only what DESIGN itself requires: `X-Request-Id` upstream (§5) and the six
//!   rate-limit headers (§3);
//! - `nocase`: as `1`, on a response rebuilt without Pingora's header-case map (names written
//!   lower-case, as HTTP/2 and Envoy do).
//!
//! Anything else is refused.

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
    headers: Headers,
}

#[derive(Clone, Copy, PartialEq)]
enum Headers {
    None,
    Forwarding,
    Design,
    NoCase,
}

/// (name as DESIGN writes it, the same lower-case, value)
const RATE_LIMIT: [(&str, &str, &str); 6] = [
    (
        "RateLimit-Policy",
        "ratelimit-policy",
        "\"default\";q=100000000;w=1",
    ),
    ("RateLimit", "ratelimit", "\"default\";r=99999999;t=1"),
    ("X-RateLimit-Limit", "x-ratelimit-limit", "100000000"),
    ("X-RateLimit-Remaining", "x-ratelimit-remaining", "99999999"),
    ("X-RateLimit-Reset", "x-ratelimit-reset", "1"),
    ("X-RateLimit-Cost", "x-ratelimit-cost", "1"),
];

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    /// Pingora's defaults otherwise: upstream keep-alive through its connection pool, no
    /// timeouts, the client's request forwarded unchanged.
    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut pingora::http::RequestHeader,
        _ctx: &mut (),
    ) -> Result<()> {
        if matches!(self.headers, Headers::Forwarding | Headers::NoCase) {
            let host = req.headers.get(http::header::HOST).cloned();
            req.insert_header(http::header::HOST, "upstream.internal")?;
            if let Some(h) = host {
                req.append_header("X-Forwarded-Host", h)?;
            }
            req.insert_header("X-Forwarded-For", "127.0.0.1")?;
            req.insert_header("X-Forwarded-Proto", "http")?;
        }
        if self.headers != Headers::None {
            req.insert_header("X-Request-Id", "0123456789abcdef0123456789abcdef")?;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut pingora::http::ResponseHeader,
        _ctx: &mut (),
    ) -> Result<()> {
        match self.headers {
            Headers::None => {}
            Headers::Forwarding | Headers::Design => {
                for (name, _, value) in RATE_LIMIT {
                    resp.append_header(name, value)?;
                }
            }
            Headers::NoCase => {
                let taken = std::mem::replace(
                    resp,
                    pingora::http::ResponseHeader::build_no_case(200, Some(0))?,
                );
                let mut parts = http::response::Parts::from(taken);
                parts.headers.reserve(RATE_LIMIT.len());
                for (_, lower, value) in RATE_LIMIT {
                    parts.headers.append(
                        http::HeaderName::from_static(lower),
                        http::HeaderValue::from_static(value),
                    );
                }
                *resp = pingora::http::ResponseHeader::from(parts);
            }
        }
        Ok(())
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
    let headers = match std::env::var("BARE_PINGORA_HEADERS").as_deref() {
        Err(_) => Headers::None,
        Ok("1") => Headers::Forwarding,
        Ok("design") => Headers::Design,
        Ok("nocase") => Headers::NoCase,
        Ok(other) => {
            eprintln!("bare_pingora: BARE_PINGORA_HEADERS={other:?}: expected 1, design or nocase");
            return ExitCode::from(2);
        }
    };
    let mut proxy =
        pingora::proxy::http_proxy_service(&server.configuration, Bare { upstream, headers });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever()
}
