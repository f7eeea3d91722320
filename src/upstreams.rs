//! Named upstreams at run time (`upstreams:`, DESIGN §1): each one a Pingora
//! [`LoadBalancer`] over its addresses, round robin, skipping those its optional active
//! health check found dead. A name with one `url` is a pool of one.
//!
//! Each address keeps its own TLS/SNI host and timeouts ([`UpstreamTarget`]); Pingora pools
//! connections per peer, so every named upstream has its own connections. Pools are built
//! from each config put in force (names resolve then, never per request). A pool's health
//! check is a [`Checker`] that outlives reloads: the next config's pool of the same name with
//! the same check takes it over, so addresses that did not change keep their health, and a
//! checker no pool uses any more stops at once (a reload starts no thread that lingers; a
//! config kept for the queued jobs of an async route the reload took away keeps its pools,
//! and their checkers, until those jobs have started: `jobs::fleet`'s `Retired`).

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use pingora::http::RequestHeader;
use pingora::lb::discovery::Static;
use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::{Backend, Backends, HealthRegistry, LoadBalancer};
use pingora::protocols::l4::ext::TCP_INFO;
use tokio::sync::{oneshot, Notify};

use crate::config::{Config, HealthCheck, NamedUpstream, UpstreamTarget};

/// Every named upstream of a config, by name.
#[derive(Default)]
pub struct Pools(HashMap<String, Arc<Pool>>);

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// One named upstream: the balancer over its resolved addresses, and each address's target.
pub struct Pool {
    lb: LoadBalancer<RoundRobin>,
    targets: HashMap<SocketAddr, UpstreamTarget>,
    /// Its health check, shared with the pools of earlier configs that had the same one.
    checker: Option<Arc<Checker>>,
}

impl Pools {
    /// Resolves every named upstream's addresses (blocking: at start and reload only). A
    /// pool whose health check is the one its namesake in `previous` had takes over that
    /// checker and the health it found; the others start checks of their own.
    pub fn build(cfg: &Config, previous: &Pools) -> Pools {
        let ca_file = cfg.upstream.ca_file.as_deref();
        let pools = cfg
            .upstreams
            .values()
            .filter_map(|u| {
                let pool = Pool::build(u, previous.0.get(&u.name), ca_file)?;
                Some((u.name.clone(), pool))
            })
            .collect();
        Pools(pools)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.0.get(name)
    }

    /// `peer`, an address of the named upstream `name` (`None`: the default upstream), did not
    /// take a connection (refused, timed out, failed its TLS handshake): noted in `refused`,
    /// never tried again for this request or job. Whether another healthy address of the pool
    /// is left to try: the upstream never had it, so it may go there whatever its method.
    pub fn refused(
        &self,
        name: Option<&str>,
        peer: &pingora::upstreams::peer::HttpPeer,
        refused: &mut Vec<SocketAddr>,
    ) -> bool {
        let (Some(pool), Some(addr)) = (name.and_then(|n| self.get(n)), peer._address.as_inet())
        else {
            return false;
        };
        refused.push(*addr);
        pool.pick(refused).is_some()
    }
}

impl Pool {
    fn build(
        u: &NamedUpstream,
        previous: Option<&Arc<Pool>>,
        ca_file: Option<&str>,
    ) -> Option<Arc<Pool>> {
        let mut targets = HashMap::new();
        for t in &u.targets {
            match (t.host.as_str(), t.port).to_socket_addrs() {
                Ok(mut addrs) => {
                    if let Some(a) = addrs.next() {
                        targets.insert(a, t.clone());
                    }
                }
                Err(e) => {
                    tracing::error!(upstream = %u.name, host = %t.host, error = %e, "an upstream address does not resolve; it is left out of the pool");
                }
            }
        }
        let checker = checker_for(u, previous, &targets, ca_file);
        let backends: BTreeSet<Backend> = targets
            .keys()
            .map(|a| Backend::new(&a.to_string()))
            .collect::<Result<_, _>>()
            .map_err(|e| tracing::error!(upstream = %u.name, error = %e, "cannot build the upstream pool"))
            .ok()?;
        let discovery = Static::new(backends);
        let backends = match &checker {
            Some((c, _)) => Backends::new_with_health_registry(discovery, c.registry.clone()),
            None => Backends::new(discovery),
        };
        let lb = LoadBalancer::<RoundRobin>::from_backends(backends);
        // Static discovery answers at once: the addresses are in the balancer after one poll.
        if !matches!(poll_once(lb.update()), Some(Ok(()))) {
            tracing::error!(upstream = %u.name, "cannot build the upstream pool");
            return None;
        }
        // Addresses the checker has not seen are healthy until checked: check them now (a new
        // checker's thread may have made its first pass before the pool gave it any).
        if let Some((c, true)) = &checker {
            c.wake.notify_one();
        }
        let checker = checker.map(|(c, _)| c);
        Some(Arc::new(Pool {
            lb,
            targets,
            checker,
        }))
    }

    /// The next healthy address, round robin, but those in `refused` (they refused this
    /// request's connection), with its target; `None` when none is.
    pub fn pick(&self, refused: &[SocketAddr]) -> Option<(SocketAddr, &UpstreamTarget)> {
        let backend = if refused.is_empty() {
            self.lb.select(b"", 256)?
        } else {
            let not_refused = |b: &Backend| b.addr.as_inet().is_some_and(|a| !refused.contains(a));
            self.lb
                .select_with(b"", 256, |b, healthy| healthy && not_refused(b))?
        };
        let addr = backend.addr.as_inet().copied()?;
        Some((addr, self.targets.get(&addr)?))
    }
}

/// The pool's health checker: its namesake's in `previous` when the check is the same, else a
/// new one; and whether it has addresses to check that it has not seen.
fn checker_for(
    u: &NamedUpstream,
    previous: Option<&Arc<Pool>>,
    targets: &HashMap<SocketAddr, UpstreamTarget>,
    ca_file: Option<&str>,
) -> Option<(Arc<Checker>, bool)> {
    let spec = CheckSpec::new(u.health_check.as_ref()?, u.targets.first()?, ca_file);
    match previous.and_then(|p| Some((p, p.checker.as_ref()?))) {
        Some((p, c)) if c.spec == spec => Some((c.clone(), !same_addresses(&p.targets, targets))),
        _ => Some((Checker::start(&u.name, spec)?, true)),
    }
}

fn same_addresses(
    a: &HashMap<SocketAddr, UpstreamTarget>,
    b: &HashMap<SocketAddr, UpstreamTarget>,
) -> bool {
    a.len() == b.len() && a.keys().all(|k| b.contains_key(k))
}

/// Polls `f` once; its output if it was ready.
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// What makes two health checks the same one: the request sent and how often.
#[derive(Debug, Clone, PartialEq)]
struct CheckSpec {
    check: HealthCheck,
    /// The target whose Host, TLS/SNI and connect timeout the check request uses.
    authority: String,
    tls: bool,
    host: String,
    connect_timeout: Duration,
    /// `upstream.ca_file`, which the pool's requests trust (Pingora's server-wide CA): the
    /// check's own connector has only the system's roots.
    ca_file: Option<String>,
}

impl CheckSpec {
    fn new(check: &HealthCheck, t: &UpstreamTarget, ca_file: Option<&str>) -> CheckSpec {
        CheckSpec {
            check: check.clone(),
            authority: t.authority.clone(),
            tls: t.tls,
            host: t.host.clone(),
            connect_timeout: t.connect_timeout,
            ca_file: ca_file.filter(|_| t.tls).map(str::to_string),
        }
    }
}

/// A pool's active health check: the health of its addresses (a Pingora [`HealthRegistry`],
/// which the balancers of successive configs share) and the thread that checks them every
/// interval. Dropping the last handle stops the thread at once, mid-check or mid-sleep.
struct Checker {
    spec: CheckSpec,
    registry: Arc<HealthRegistry>,
    /// Asks for a check now (new addresses).
    wake: Arc<Notify>,
    /// Dropped with the checker, which ends its thread.
    _stop: oneshot::Sender<()>,
}

impl Checker {
    fn start(name: &str, spec: CheckSpec) -> Option<Arc<Checker>> {
        let Some(check) = health_check(&spec) else {
            tracing::error!(upstream = %name, "cannot build the health check request");
            return None;
        };
        let registry = Arc::new(HealthRegistry::new());
        registry.set_health_check(check);
        let (stop_tx, mut stop) = oneshot::channel::<()>();
        let wake = Arc::new(Notify::new());
        let (reg, woken, interval) = (registry.clone(), wake.clone(), spec.check.interval);
        let spawned = crate::background::spawn(format!("tollgate-hc-{name}"), move || async move {
            loop {
                tokio::select! {
                    _ = reg.run_health_check(true) => {}
                    _ = &mut stop => return,
                }
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = woken.notified() => {}
                    _ = &mut stop => return,
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(upstream = %name, error = %e, "cannot start the health check");
        }
        Some(Arc::new(Checker {
            spec,
            registry,
            wake,
            _stop: stop_tx,
        }))
    }
}

/// The CA certificates of PEM file `file`, as a peer trusts them instead of the system's.
fn trusted(file: &str) -> Option<Arc<pingora::protocols::tls::CaType>> {
    use rustls_pki_types::pem::PemObject;
    let certs: Vec<pingora::utils::tls::WrappedX509> =
        rustls_pki_types::CertificateDer::pem_file_iter(file)
            .ok()?
            .filter_map(Result::ok)
            // Parsed as Pingora will (it panics on what x509-parser refuses: skipped here).
            .filter(|der| x509_parser::parse_x509_certificate(der).is_ok())
            .map(|der| {
                pingora::utils::tls::WrappedX509::new(der.to_vec(), pingora::utils::tls::parse_x509)
            })
            .collect();
    (!certs.is_empty()).then(|| Arc::from(certs))
}

/// `GET <path>` with the upstream's Host, any 200 being healthy; one failure marks an
/// address down and one success up again.
fn health_check(spec: &CheckSpec) -> Option<Box<HttpHealthCheck>> {
    let mut check = HttpHealthCheck::new(&spec.authority, spec.tls);
    if spec.tls {
        check.peer_template.sni = spec.host.clone();
    }
    if let Some(file) = &spec.ca_file {
        check.peer_template.options.ca = Some(trusted(file)?);
    }
    let mut req = RequestHeader::build("GET", spec.check.path.as_bytes(), None).ok()?;
    req.append_header("Host", spec.authority.as_str()).ok()?;
    check.req = req;
    check.peer_template.options.connection_timeout = Some(spec.connect_timeout);
    Some(Box::new(check))
}

/// The peer for the configured upstream at its resolved address.
pub fn peer(addr: SocketAddr, up: &UpstreamTarget) -> pingora::upstreams::peer::HttpPeer {
    let mut peer = pingora::upstreams::peer::HttpPeer::new(addr, up.tls, up.host.clone());
    peer.options.connection_timeout = Some(up.connect_timeout);
    peer.options.total_connection_timeout = Some(up.connect_timeout * 2);
    peer.options.read_timeout = Some(up.read_timeout);
    peer.options.write_timeout = Some(up.read_timeout);
    peer.options.idle_timeout = Some(Duration::from_secs(60));
    peer
}

/// The least time after which an upstream that closed the connection under a request is taken
/// to have read it ([`had_request`]); [`stale_within`] widens it for a distant upstream.
pub const STALE_WITHIN: Duration = Duration::from_millis(100);

/// The round trip last measured to each upstream address (by the kernel, on a new connection),
/// for [`stale_within`]: one entry per address the gateway connected to.
static ROUND_TRIPS: std::sync::LazyLock<std::sync::Mutex<HashMap<String, Duration>>> =
    std::sync::LazyLock::new(Default::default);

/// Notes the round trip of a new connection to `addr` (once per connection, not per request).
pub fn note_round_trip(addr: &impl std::fmt::Display, digest: Option<&pingora::protocols::Digest>) {
    let Some(info) = digest
        .and_then(|d| d.socket_digest.as_ref())
        .and_then(|s| s.tcp_info())
    else {
        return;
    };
    // Microseconds; the deviation counts four times, as in the kernel's retransmission timer.
    let rtt = Duration::from_micros(u64::from(info.tcpi_rtt) + 4 * u64::from(info.tcpi_rttvar));
    if let Ok(mut m) = ROUND_TRIPS.lock() {
        m.insert(addr.to_string(), rtt);
    }
}

/// How soon after a request went out a close without a byte of answer means the upstream
/// never read it: the race with an upstream closing a kept-alive connection while it was idle
/// (its keep-alive timeout), or a proxy before a dead backend that accepts and closes at once.
/// That close arrives within a round trip or two; [`STALE_WITHIN`], or twice `addr`'s round
/// trip where that is longer.
pub fn stale_within(addr: &impl std::fmt::Display) -> Duration {
    let rtt = ROUND_TRIPS
        .lock()
        .ok()
        .and_then(|m| m.get(&addr.to_string()).copied());
    rtt.map_or(STALE_WITHIN, |r| STALE_WITHIN.max(2 * r))
}

/// Whether an upstream that failed before answering had the request, so may have run it
/// (DESIGN §3: such a request stays charged and is never sent again), given the error, how
/// long ago the request's head went out (`None`: it never did) and [`stale_within`]. It never
/// had it when the connection could not be made, or when the connection failed (closed,
/// reset, a write refused) within `within` of sending: the upstream had closed it or was
/// closing it. Later, it read the request and worked on it.
pub fn had_request(e: &pingora::Error, since_sent: Option<Duration>, within: Duration) -> bool {
    use pingora::ErrorType::*;
    let Some(since) = since_sent else {
        return false;
    };
    match e.etype() {
        ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError | ConnectProxyFailure
        | TLSWantX509Lookup | TLSHandshakeFailure | TLSHandshakeTimedout | InvalidCert
        | HandshakeError | BindError | SocketError => false,
        ReadError | WriteError | ConnectionClosed => since >= within,
        _ => true,
    }
}

/// Whether an upstream that closed its connection without answering (`e`) read the request
/// first, by the connection's TCP state (`info`, read when the close was seen): it closed in
/// order (the connection waits for our side to close: CLOSE_WAIT, not reset) and its kernel
/// had acknowledged every byte written (none unacknowledged, none still unsent). One that
/// closes with the request unread in its socket resets the connection instead; one that
/// closed before the request arrived (a kept-alive connection given up on as it was sent: the
/// keep-alive race) has the request reset, still unacknowledged or unsent. So this needs no
/// time window ([`had_request`]'s), which on loopback took an upstream that read the request
/// and hung up at once for one that never had it.
pub fn read_before_closing(e: &pingora::Error, info: Option<TCP_INFO>) -> bool {
    /// `TCP_CLOSE_WAIT` of the kernel's `enum tcp_state`.
    const CLOSE_WAIT: u8 = 8;
    matches!(e.etype(), pingora::ErrorType::ConnectionClosed)
        && info.is_some_and(|i| {
            i.tcpi_state == CLOSE_WAIT && i.tcpi_unacked == 0 && i.tcpi_notsent_bytes == 0
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::{Error, ErrorType};

    #[test]
    fn the_upstream_had_a_request_once_it_was_written_and_not_closed_under_it_at_once() {
        let within = STALE_WITHIN;
        let had = |t: ErrorType, ms: Option<u64>| {
            had_request(&Error::new(t), ms.map(Duration::from_millis), within)
        };
        // Never written, or refused at once.
        assert!(!had(ErrorType::ConnectRefused, Some(500)));
        assert!(!had(ErrorType::TLSHandshakeFailure, Some(500)));
        assert!(!had(ErrorType::ConnectionClosed, None));
        for t in [
            ErrorType::ConnectionClosed,
            ErrorType::ReadError,
            ErrorType::WriteError,
        ] {
            // Closed under it as it went out (an idle connection's race, a dead backend).
            assert!(!had(t.clone(), Some(0)));
            assert!(!had(t.clone(), Some(99)));
            // Read, worked on, then the connection closed or reset without an answer.
            assert!(had(t.clone(), Some(100)));
            assert!(had(t, Some(300)));
        }
        // An answer that was no HTTP: the upstream had the request.
        assert!(had(ErrorType::InvalidHTTPHeader, Some(1)));
    }

    #[test]
    fn a_distant_upstream_has_a_longer_window() {
        assert_eq!(stale_within(&"192.0.2.1:1"), STALE_WITHIN);
        ROUND_TRIPS
            .lock()
            .unwrap()
            .insert("192.0.2.2:1".into(), Duration::from_millis(150));
        assert_eq!(stale_within(&"192.0.2.2:1"), Duration::from_millis(300));
    }
}
