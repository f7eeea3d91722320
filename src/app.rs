//! Assembling and running a gateway process: config, store, Pingora server, admin listener,
//! signals (SIGHUP reload, SIGTERM drain) — the one place that knows about all of them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};

use crate::config::{Backend, Config, ConfigErrors, EnvOverrides};
use crate::front::{FrontDoor, Listeners};
use crate::proxy::Gateway;
use crate::shutdown::Drained;
use crate::state::Shared;
use crate::store::memory::Clock;
use crate::store::{MemoryStore, RedisStore, Store};
use crate::telemetry::{metrics, Reload};
use crate::tls::CertResolver;
use pingora::tls::sign::CertifiedKey;

/// A running gateway's handles, for the signal handlers and the file watcher.
pub struct App {
    pub shared: Arc<Shared>,
    pub config_path: PathBuf,
    pub env: EnvOverrides,
    /// The TLS listener's certificate (`server.tls`), replaced on reload.
    pub tls: Option<Arc<CertResolver>>,
}

impl App {
    /// Re-reads the config file; a valid one replaces the running config for new requests,
    /// an invalid one is logged (with field paths) and counted, and the old one stays.
    pub fn reload(&self) -> Result<(), ConfigErrors> {
        let m = metrics();
        match Config::load(&self.config_path, &self.env) {
            Ok(new) => {
                let cert = self.tls_on_reload(&new);
                crate::jobs::announce(&new.router);
                self.shared.install(new);
                if let (Some(resolver), Some(cert)) = (&self.tls, cert) {
                    // Validation has read the files: this is the pair now on disk.
                    resolver.replace(cert);
                }
                m.config_reload(Reload::Ok);
                tracing::info!(path = %self.config_path.display(), "configuration reloaded");
                Ok(())
            }
            Err(errs) => {
                m.config_reload(Reload::Error);
                let (shown, more) = errs.shown();
                if more > 0 {
                    tracing::error!(path = %self.config_path.display(), more, "configuration reload rejected with more errors than are logged");
                }
                for e in shown {
                    tracing::error!(path = %self.config_path.display(), error = %e, "configuration reload rejected; keeping the running config");
                }
                Err(errs)
            }
        }
    }

    /// The certificate to serve from now on; listener changes need a restart, said so.
    fn tls_on_reload(&self, new: &Config) -> Option<Arc<CertifiedKey>> {
        let running = self.shared.running();
        match (&running.config.tls, &new.tls, &self.tls) {
            (Some(was), Some(now), Some(_)) => {
                if was.listen != now.listen {
                    tracing::warn!(
                        listen = %was.listen,
                        "server.tls.listen takes effect on restart only; keeping the running listener"
                    );
                }
                Some(now.certified.clone())
            }
            (None, Some(_), _) => {
                tracing::warn!("server.tls takes effect on restart only");
                None
            }
            (Some(_), None, _) => {
                tracing::warn!(
                    "removing server.tls takes effect on restart only; serving the last certificate"
                );
                None
            }
            _ => None,
        }
    }
}

/// Under `on_error: local` each instance has `1/fleet_size` of every budget: a route whose
/// cost is larger than that share cannot pass at all while Redis is down. Said at start.
fn warn_unaffordable_in_fallback(cfg: &Config) {
    if cfg.store.backend != Backend::Redis || cfg.store.on_error != crate::config::OnError::Local {
        return;
    }
    let n = cfg.store.fleet_size as u64;
    let budgets = std::iter::once(&cfg.default_policy).chain(cfg.plans.values());
    for p in budgets.flat_map(|p| &p.budgets) {
        for r in cfg.router.routes() {
            if r.cost * n > p.max_cost {
                tracing::warn!(
                    route = %r.label,
                    cost = r.cost,
                    budget = %p.name,
                    share = p.max_cost / n,
                    "while Redis is unreachable (on_error: local) each instance has max_cost/fleet_size of this budget, less than this route's cost: the route will be refused until Redis is back"
                );
            }
        }
    }
}

/// Builds the store a config asks for. The Redis store connects lazily, so this never fails
/// and the gateway starts while Redis is down.
pub fn build_store(cfg: &Config, clock: Clock) -> Store {
    match cfg.store.backend {
        Backend::Memory => Store::Memory(MemoryStore::new(clock)),
        Backend::Redis => Store::Redis(RedisStore::new(&cfg.store, clock)),
    }
}

/// `TOLLGATE_CLOCK_OFFSET_MS` skews this instance's local clock (used by tests to prove that
/// instances with different clocks agree, since the shared store uses Redis's clock).
fn clock_from_env() -> Clock {
    let offset_ms: i64 = std::env::var("TOLLGATE_CLOCK_OFFSET_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Clock::new(offset_ms.saturating_mul(1000))
}

struct Signals {
    app: Arc<App>,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut hup), Ok(mut term), Ok(mut int), Ok(mut quit)) = (
            signal(SignalKind::hangup()),
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::quit()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return ShutdownSignal::FastShutdown;
        };
        let reloads = spawn_reloader(self.app.clone());
        loop {
            tokio::select! {
                // Never awaited here: a reload that blocks (a FIFO for a file, a slow DNS
                // answer for an upstream's name) must not keep SIGTERM from being handled.
                _ = hup.recv() => reloads.ask(),
                _ = term.recv() => {
                    self.app.shared.drain.start();
                    spawn_drain_watch(self.app.clone());
                    return ShutdownSignal::GracefulTerminate;
                }
                _ = int.recv() => {
                    // A fast exit: give the fleet back this instance's slots first, write the
                    // log out, and go. Not through Pingora's fast shutdown, which joins every
                    // worker thread without a bound: in CI an instance once never exited
                    // after SIGINT that way (a worker that did not come back to its runtime).
                    give_back_held(&self.app).await;
                    cut_off_running(&self.app).await;
                    self.app.shared.store.release_all().await;
                    let store = &self.app.shared.store;
                    store.written_back_by(Instant::now() + WRITE_BACK_AT_EXIT).await;
                    flush_spans(&self.app);
                    crate::telemetry::flush_logs();
                    crate::pid_file::remove();
                    std::process::exit(0);
                }
                _ = quit.recv() => return ShutdownSignal::GracefulUpgrade,
            }
        }
    }
}

/// The reloads SIGHUP asks for, one at a time on a task of their own: each signal while one
/// runs makes one more after it (several make one: the file as it is then wins).
struct Reloads {
    asked: tokio::sync::Notify,
    running: std::sync::atomic::AtomicBool,
}

impl Reloads {
    fn ask(&self) {
        if self.running.load(std::sync::atomic::Ordering::Acquire) {
            // One that never ends (a FIFO nobody writes) would hide every later one: said.
            tracing::warn!("SIGHUP while a reload is still running: it follows that one");
        }
        self.asked.notify_one();
    }
}

fn spawn_reloader(app: Arc<App>) -> Arc<Reloads> {
    let reloads = Arc::new(Reloads {
        asked: tokio::sync::Notify::new(),
        running: Default::default(),
    });
    let r = reloads.clone();
    tokio::spawn(async move {
        use std::sync::atomic::Ordering;
        loop {
            r.asked.notified().await;
            r.running.store(true, Ordering::Release);
            let app = app.clone();
            // Reading and validating the file is blocking work.
            let _ = tokio::task::spawn_blocking(move || app.reload()).await;
            r.running.store(false, Ordering::Release);
        }
    });
    reloads
}

const DRAIN_QUIET: Duration = Duration::from_secs(1);

/// Pingora's graceful shutdown stops accepting and then waits out the whole grace period. We
/// exit as soon as the last in-flight request has finished, or when `grace_period` ends,
/// whichever is first.
fn spawn_drain_watch(app: Arc<App>) {
    let grace = app.shared.running().config.grace_period;
    // A request held for a turn past the grace period would never go from here.
    let ends = Instant::now() + grace;
    app.shared.drain.give_back_held_past(ends);
    std::thread::spawn(move || {
        let start = Instant::now();
        // Let the listeners see the shutdown broadcast before counting.
        std::thread::sleep(Duration::from_millis(100));
        match app.shared.drain.wait(DRAIN_QUIET, grace) {
            Drained::Idle => tracing::info!(
                elapsed_ms = start.elapsed().as_millis() as u64,
                "drained; exiting"
            ),
            Drained::GraceOver { active } => {
                tracing::warn!(active, "grace period over with requests in flight; exiting")
            }
        }
        // What the fallback admitted is written back within the grace period (the store
        // may be about to return), or at least within WRITE_BACK_AT_EXIT of the release.
        release_leases(&app, ends);
        flush_spans(&app);
        crate::telemetry::flush_logs();
        crate::pid_file::remove();
        std::process::exit(0);
    });
}

/// How long an exit waits at least for the write-back of what the fallback admitted (an
/// exit past its grace period, and SIGINT's, wait this long).
const WRITE_BACK_AT_EXIT: Duration = Duration::from_secs(1);

/// Seconds Pingora's runtimes outlive the grace period, for the drain thread's last steps:
/// held turns given back (1.1 s at most), running requests cut off (`CUT_OFF_WAIT`), leases
/// released (1 s), the write-back (`WRITE_BACK_AT_EXIT` at least), spans and logs flushed (2 s
/// and 1 s), and a margin.
const EXIT_ROOM: u64 = 8;

/// How long an exit waits for the requests it cut off to be answered and logged.
const CUT_OFF_WAIT: Duration = Duration::from_secs(1);

/// Cuts off the requests still running as the instance exits (past its grace period, or at
/// SIGINT): each one's upstream socket is shut down, so that it fails on its own worker, is
/// answered (502, charged: the upstream had it) and gets its access-log line, as every
/// request does (DESIGN §5); waits up to [`CUT_OFF_WAIT`] for them.
async fn cut_off_running(app: &App) {
    let drain = &app.shared.drain;
    if drain.cut_off() == 0 {
        return;
    }
    wait_until(CUT_OFF_WAIT, || drain.active() == 0).await;
}

/// Waits until `done` holds (looked at every 10 ms), for at most `within`.
async fn wait_until(within: Duration, done: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !done() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An exiting instance gives back the reservations of the requests it still holds for their
/// `max_delay` turn, then frees the fleet's slots it holds (the store bounds this to 1 s), and
/// waits until `write_back_by` (at least [`WRITE_BACK_AT_EXIT`] from then) for what its
/// fallback admitted to be written back, on a runtime of its own: this runs on the drain
/// thread.
fn release_leases(app: &App, write_back_by: Instant) {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(async {
            give_back_held(app).await;
            cut_off_running(app).await;
            app.shared.store.release_all().await;
            let by = write_back_by.max(Instant::now() + WRITE_BACK_AT_EXIT);
            app.shared.store.written_back_by(by).await
        }),
        Err(e) => tracing::warn!(error = %e, "cannot release leases before exit"),
    }
}

/// Has every request still held for its `max_delay` turn give its reservation back, and every
/// one still waiting for a capped route's slot leave the queue (its charge back), and be
/// refused (each on its own worker: `proxy::decide`), waiting up to 1 s for them; a held
/// request's permit (`Shared::holds`) and a waiting one's count (`Drain::waiting`) go back
/// once its answer has been handed to the connection (`Ctx::given_back`, `Ctx::leaving`,
/// dropped with its context after its log line).
async fn give_back_held(app: &App) {
    let drain = &app.shared.drain;
    let waiting = || app.shared.holds.held() + drain.waiting_now();
    let held = waiting() > 0;
    drain.give_back_held_past(Instant::now());
    wait_until(Duration::from_secs(1), || waiting() == 0).await;
    if held {
        // A permit goes back once its answer is handed to the connection; an HTTP/2 stream's
        // last frame is written by the connection's own task, a moment later.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The spans still queued go to the collector before exit, for at most 2 s (a dead one
/// must not hold the exit up).
fn flush_spans(app: &App) {
    if let Some(t) = &app.shared.tracing {
        t.shutdown(Duration::from_secs(2));
    }
}

/// `run --watch`: reloads when the file's content changes (checked every second), as SIGHUP
/// would. Content, not mtime, so that editors and ConfigMap symlink swaps are both seen.
fn spawn_file_watch(app: Arc<App>) {
    std::thread::spawn(move || {
        let read = || crate::config::read_bounded(&app.config_path).ok();
        let mut last = read();
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let now = read();
            if now.is_some() && now != last {
                last = now;
                let _ = app.reload();
            }
        }
    });
}

/// Serves `cfg` (loaded from `config_path`) until SIGTERM/SIGINT. Returns an error only for
/// start-up failures.
pub fn run(cfg: Config, config_path: &Path, watch: bool) -> anyhow::Result<()> {
    let env = EnvOverrides::from_env();
    let store = build_store(&cfg, clock_from_env());
    run_with(cfg, config_path.to_path_buf(), env, store, watch)
}

/// A listening socket for `addr` with a backlog like Pingora's (std's is 128: a burst of
/// connections beyond it would wait for SYN retries instead of being refused at once).
fn bind(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd;
    let l = std::net::TcpListener::bind(addr)?;
    // SAFETY: `l` owns the socket; listen(2) on a listening socket only changes its backlog.
    if unsafe { libc::listen(l.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l)
}

const LISTEN_BACKLOG: i32 = 65535;

/// RLIMIT_NOFILE's soft limit up to the hard one (DESIGN §5), said in the log.
fn raise_fd_limit() {
    match crate::accept::raise_fd_limit() {
        Ok(n) => tracing::info!(open_files = n, "file descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the file descriptor limit"),
    }
}

/// Pingora's settings for this process.
fn server_conf(threads: usize, grace: Duration, ca_file: Option<String>) -> ServerConf {
    // Per-process paths: Pingora's defaults are fixed /tmp names that two instances would share.
    let tag = std::process::id();
    ServerConf {
        threads,
        // One single-threaded runtime per worker: no cross-thread wake-ups on the hot path, and
        // each worker's Redis connection lives on the runtime that uses it.
        work_stealing: false,
        // Pingora stops the worker runtimes (and every task on them: the write-back's) this
        // long after SIGTERM; the drain thread exits before, once it has given back, released
        // and written back what it must (`spawn_drain_watch`): room for that, past the grace.
        grace_period_seconds: Some(
            grace.as_secs() + u64::from(grace.subsec_nanos() > 0) + EXIT_ROOM,
        ),
        graceful_shutdown_timeout_seconds: Some(1),
        // Trusted CAs for https upstreams (Pingora's connector reads this once, at start).
        ca_file,
        pid_file: std::env::temp_dir()
            .join(format!("tollgate-{tag}.pid"))
            .display()
            .to_string(),
        upgrade_sock: std::env::temp_dir()
            .join(format!("tollgate-{tag}.sock"))
            .display()
            .to_string(),
        ..ServerConf::default()
    }
}

/// [`run`] with the store, the environment and the config's path given (`tollgate demo`
/// passes its own).
pub fn run_with(
    cfg: Config,
    config_path: PathBuf,
    env: EnvOverrides,
    store: Store,
    watch: bool,
) -> anyhow::Result<()> {
    // A refused admin token stops the start before anything is bound or started (its error,
    // not a port clash's, is what the operator then reads).
    let admin_token = crate::admin::token::from_env()?;
    raise_fd_limit();
    warn_unaffordable_in_fallback(&cfg);
    store.publish_gauges();
    let listen = cfg.listen.clone();
    let admin_addr: SocketAddr = cfg.admin_listen.parse()?;
    let threads = cfg.threads;
    let grace = cfg.grace_period;
    let ca_file = cfg.upstream.ca_file.clone();
    let tls = cfg.tls.clone();
    let resolver = tls.as_ref().map(|t| CertResolver::new(t.certified.clone()));
    // Before any runtime exists: the exporter's HTTP client is a blocking one.
    let tracing = cfg
        .tracing
        .as_ref()
        .map(|t| crate::trace::Tracing::start(t).map_err(|e| anyhow::anyhow!("tracing: {e}")))
        .transpose()?;
    crate::jobs::announce(&cfg.router);
    let shared = Shared::new(cfg, store, tracing);
    // On Redis, this instance takes its share of the fleet's async jobs (DESIGN §8).
    if matches!(shared.store, crate::store::Store::Redis(_)) {
        crate::jobs::fleet::start_collector(shared.clone());
    }
    let app = Arc::new(App {
        shared: shared.clone(),
        config_path,
        env,
        tls: resolver.clone(),
    });

    // Bind the admin port before anything else so a clash fails loudly at start.
    let admin_listener = std::net::TcpListener::bind(admin_addr)
        .map_err(|e| anyhow::anyhow!("server.admin_listen {admin_addr}: {e}"))?;
    crate::admin::spawn(admin_listener, shared.clone(), admin_token)?;
    if watch {
        spawn_file_watch(app.clone());
    }
    let conf = server_conf(threads, grace, ca_file);
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let proxy = pingora::proxy::http_proxy(
        &server.configuration,
        Gateway {
            shared: shared.clone(),
        },
    );
    let mut service = Listeners::new(FrontDoor::new(proxy, shared.clone()));
    for a in &listen {
        // Bound here so a port clash is an error at start, not a panic inside Pingora.
        let l = bind(a).map_err(|e| anyhow::anyhow!("server.listen {a}: {e}"))?;
        service.add_tcp(l);
    }
    // The TLS listener belongs to the same service, so that one front door counts (and
    // limits) the connections of both.
    if let (Some(t), Some(resolver)) = (&tls, resolver) {
        let l =
            bind(&t.listen).map_err(|e| anyhow::anyhow!("server.tls.listen {}: {e}", t.listen))?;
        let settings =
            crate::tls::settings(resolver).map_err(|e| anyhow::anyhow!("server.tls: {e}"))?;
        service.add_tls(l, settings);
    }
    server.add_service(service);
    let tls_listen = tls.as_ref().map(|t| t.listen.as_str());
    tracing::info!(listen = ?listen, tls = ?tls_listen, admin = %admin_addr, "tollgate serving");
    server.run(RunArgs {
        shutdown_signal: Box::new(Signals { app }),
    });
    Ok(())
}
