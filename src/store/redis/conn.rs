//! Connections to Redis — one node, a Cluster, or the primary a Sentinel group names — one
//! per worker thread, made lazily.
//!
//! A redis-rs connection's driver task runs on the runtime that created it, and each Pingora
//! worker is a current-thread runtime of its own: so each thread connects on first use (on its
//! own runtime), concurrent requests on it share that one connection, and a connection that
//! failed or timed out is dropped and made again on the next call. Connecting lazily is also
//! what lets the gateway start while Redis is down. A connection is looked at every second
//! (a `PING` beside the calls, on a Cluster to every primary): one the server closed (a
//! restart, `CLIENT KILL`, an idle `timeout`) is not used again (a Cluster's node connection
//! is mended by the cluster client), so the next call does not fail on it, however long the
//! thread stayed idle.
//!
//! Making a connection again is also how a topology change is followed:
//! - Sentinel: the Sentinels are asked for the primary's address on every connect, and a
//!   watcher (`sentinel`) follows their failovers as they happen: calls pause while one is
//!   under way, and connections made before `+switch-master` are made again. A new
//!   connection asks the node its `ROLE` first.
//! - Cluster: the client reads the slot map from the seed nodes when it connects and again on
//!   MOVED; a dead primary's slots are re-read on reconnect once its replica took over.
//!
//! The cluster client is built with no retries of its own: it would resend a command after a
//! timeout or a dropped connection, and the charging script must never be sent twice (it may
//! have run). What is surely safe to resend is resent by `script::invoke`.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::sentinel::SentinelNodeConnectionInfo;
use redis::{AsyncConnectionConfig, Cmd, ConnectionInfo, IntoConnectionInfo, RedisFuture, Value};

use super::lost::RunId;
use super::sentinel::{self, Watch};
use super::RedisBackend;
use crate::config::{parse_redis_target, RedisTarget, StoreUrlError};
use crate::store::StoreError;

mod primary;

/// "host:port" of a node, as the Sentinels name it.
fn address(info: &ConnectionInfo) -> String {
    match info.addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port}"),
        other => other.to_string(),
    }
}

/// How often a node connection is checked ([`watch`]).
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// A thread's connection, and whether its watcher still finds it open.
struct Cached {
    /// The [`Connections`] it belongs to.
    id: u64,
    /// The primary's generation it was made for (Sentinel).
    generation: u64,
    conn: Conn,
    /// Cleared by [`watch`] when the server closed it.
    open: Arc<AtomicBool>,
    /// Dropped with the entry (forgotten, replaced): the watcher stops at once, and lets go
    /// of its copy of the connection.
    _watched: Option<tokio::sync::oneshot::Sender<()>>,
}

thread_local! {
    /// This thread's connection.
    static CONN: RefCell<Option<Cached>> = const { RefCell::new(None) };
    /// Held while this thread connects, so concurrent requests wait for one connection
    /// instead of each opening their own.
    static CONNECTING: Arc<tokio::sync::Mutex<()>> = Arc::new(tokio::sync::Mutex::new(()));
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One connection, whatever `store.url` names; cheap to clone (they share the socket(s)).
#[derive(Clone)]
pub(super) enum Conn {
    /// A single node, or the primary a Sentinel named.
    Node(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// How to reach the store, built once from `store.url` (no connection yet).
enum Target {
    Node(redis::Client),
    /// The client, and a client for each seed node: classic Pub/Sub messages reach every
    /// node of a Cluster, so any one node that answers is enough to listen on.
    Cluster(Box<ClusterClient>, Vec<redis::Client>),
    Sentinel {
        sentinels: Vec<ConnectionInfo>,
        master: String,
        primary: SentinelNodeConnectionInfo,
    },
}

/// Why `store.url` cannot make a client ([`StoreError::Config`]): `check` refuses such a URL,
/// but `TOLLGATE_REDIS_URL` may bring one at start.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UnusableUrl {
    #[error(transparent)]
    Url(#[from] StoreUrlError),
    #[error(transparent)]
    Client(#[from] redis::RedisError),
}

impl Target {
    fn open(
        url: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<Self, UnusableUrl> {
        Ok(match parse_redis_target(url)? {
            RedisTarget::Node(url) => Target::Node(redis::Client::open(url)?),
            RedisTarget::Cluster { seeds } => {
                let nodes = seeds
                    .iter()
                    .map(|s| redis::Client::open(s.as_str()))
                    .collect::<Result<Vec<_>, _>>()?;
                Target::Cluster(
                    Box::new(
                        ClusterClient::builder(seeds)
                            .retries(0)
                            .connection_timeout(connect_timeout)
                            .response_timeout(response_timeout)
                            .build()?,
                    ),
                    nodes,
                )
            }
            RedisTarget::Sentinel {
                sentinels,
                master,
                primary,
            } => {
                let primary = primary.into_connection_info()?;
                let mut node = SentinelNodeConnectionInfo::default()
                    .set_redis_connection_info(primary.redis_settings().clone());
                if let redis::ConnectionAddr::TcpTls { insecure, .. } = primary.addr() {
                    node = node.set_tls_mode(if *insecure {
                        redis::TlsMode::Insecure
                    } else {
                        redis::TlsMode::Secure
                    });
                }
                Target::Sentinel {
                    sentinels: sentinels
                        .into_iter()
                        .map(|s| s.into_connection_info())
                        .collect::<Result<_, _>>()?,
                    master,
                    primary: node,
                }
            }
        })
    }
}

/// How to reach one store; tells its thread-local connections apart from another store's.
pub(super) struct Connections {
    id: u64,
    target: Result<Target, UnusableUrl>,
    /// Sentinel: what the watcher knows of the primary (a failover under way, a new one).
    watch: Option<Arc<Watch>>,
    /// The Redis process's `run_id` (each Cluster primary's), read on every new connection.
    pub(super) run_id: Arc<RunId>,
    config: AsyncConnectionConfig,
    /// Bound on making a connection: `max(store.timeout, 100ms)`, since a TCP (and TLS)
    /// handshake needs more than a call.
    connect_timeout: Duration,
    /// Sentinel: a primary's connection settings as redis-rs made them (TLS, password,
    /// database), for connecting straight to the primary the watcher names.
    settings: Mutex<Option<ConnectionInfo>>,
}

impl Connections {
    /// `response_timeout` bounds how long a reply is awaited on the connection itself; calls
    /// are bounded by `store.timeout` by their callers.
    pub(super) fn new(url: &str, timeout: Duration, response_timeout: Duration) -> Self {
        let connect_timeout = timeout.max(Duration::from_millis(100));
        let target = Target::open(url, connect_timeout, response_timeout);
        if let Err(e) = &target {
            tracing::error!(error = %e, "store.url is not usable; running on store.on_error");
        }
        let watch = match &target {
            Ok(Target::Sentinel {
                sentinels, master, ..
            }) => {
                let watch = Arc::new(Watch::new());
                sentinel::spawn_watcher(sentinels.clone(), master.clone(), Arc::downgrade(&watch));
                Some(watch)
            }
            _ => None,
        };
        Connections {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            target,
            watch,
            run_id: Arc::default(),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(Some(response_timeout)),
            connect_timeout,
            settings: Mutex::new(None),
        }
    }

    /// A Redis Cluster: keys of different hash tags cannot meet in one script call.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.target, Ok(Target::Cluster(..)))
    }

    /// The generation of the primary connections are made to now (0 but for Sentinel).
    fn generation(&self) -> u64 {
        self.watch.as_ref().map_or(0, |w| w.generation())
    }

    fn cached(&self) -> Option<Conn> {
        let generation = self.generation();
        CONN.with(|c| {
            c.borrow()
                .as_ref()
                .filter(|c| {
                    c.id == self.id && c.generation == generation && c.open.load(Ordering::Relaxed)
                })
                .map(|c| c.conn.clone())
        })
    }

    /// This thread's connection, made on first use (on this thread's runtime). While the
    /// Sentinels fail the primary over, none: [`StoreError::FailingOver`].
    pub(super) async fn get(&self) -> Result<Conn, StoreError> {
        if self.watch.as_ref().is_some_and(|w| w.paused()) {
            return Err(StoreError::FailingOver);
        }
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        // Boxed: connecting is rare, and its future (the client's handshake, Sentinel's
        // questions) is kilobytes that every call's future would otherwise carry and copy.
        Box::pin(self.open()).await
    }

    /// This thread's connection made (one connection attempt at a time per thread).
    async fn open(&self) -> Result<Conn, StoreError> {
        let target = self
            .target
            .as_ref()
            .map_err(|e| StoreError::Config(e.clone()))?;
        let lock = CONNECTING.with(|l| l.clone());
        tokio::time::timeout(self.connect_timeout, async {
            let _one_at_a_time = lock.lock().await;
            if let Some(c) = self.cached() {
                return Ok(c);
            }
            let generation = self.generation();
            let conn = self.connect(target).await.map_err(StoreError::Connect)?;
            let open = Arc::new(AtomicBool::new(true));
            let watched = watch(conn.clone(), open.clone());
            CONN.with(|c| {
                *c.borrow_mut() = Some(Cached {
                    id: self.id,
                    generation,
                    conn: conn.clone(),
                    open,
                    _watched: watched,
                })
            });
            Ok(conn)
        })
        .await
        .map_err(|_| StoreError::ConnectTimeout)?
    }

    async fn connect(&self, target: &Target) -> redis::RedisResult<Conn> {
        Ok(match target {
            Target::Node(client) => {
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?;
                self.run_id.read(&mut conn).await;
                Conn::Node(conn)
            }
            Target::Cluster(client, _) => {
                let conn = client.get_async_connection().await?;
                // Its primaries' `run_id`s beside it: a read of every primary on the way to
                // the connection would delay it (and fails whole while one is down).
                let (mut read_on, ids) = (conn.clone(), self.run_id.clone());
                tokio::spawn(async move { ids.read(&mut read_on).await });
                Conn::Cluster(conn)
            }
            Target::Sentinel { .. } => {
                let client = self.known_primary(target).await?;
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?;
                sentinel::check_role(&mut conn).await?;
                self.run_id.read(&mut conn).await;
                Conn::Node(conn)
            }
        })
    }

    /// A Pub/Sub connection of its own (a subscribed connection can send nothing else): to
    /// the node, a Cluster's first seed, or the primary the Sentinels name now.
    pub(super) async fn pubsub(&self) -> redis::RedisResult<redis::aio::PubSub> {
        let target = self.target.as_ref().map_err(|e| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "store.url",
                e.to_string(),
            ))
        })?;
        match target {
            Target::Node(client) => client.get_async_pubsub().await,
            Target::Cluster(_, nodes) => {
                let mut last = None;
                for node in nodes {
                    match tokio::time::timeout(self.connect_timeout, node.get_async_pubsub()).await
                    {
                        Ok(Ok(ps)) => return Ok(ps),
                        Ok(Err(e)) => last = Some(e),
                        Err(_) => {}
                    }
                }
                Err(last.unwrap_or_else(|| {
                    redis::RedisError::from((redis::ErrorKind::Io, "no cluster node answered"))
                }))
            }
            Target::Sentinel { .. } => self.known_primary(target).await?.get_async_pubsub().await,
        }
    }

    /// A timed-out or broken connection is not trusted again: the next call connects anew.
    pub(super) fn forget(&self) {
        CONN.with(|c| {
            let mut c = c.borrow_mut();
            if c.as_ref().is_some_and(|c| c.id == self.id) {
                *c = None;
            }
        });
    }
}

/// How soon a subscription that never connected, or broke sooner than this after it was
/// made, is tried again; one that had lived longer is made again at once (a grant published
/// meanwhile is not heard: it waits for the next beat).
pub(super) const SUBSCRIBE_AGAIN_AFTER: Duration = Duration::from_millis(500);

/// A Pub/Sub connection of its own subscribed to `channel`; `None` (logged at debug) when
/// the store is gone, Redis cannot be reached, or it refuses the subscription (an ACL).
pub(super) async fn subscribe(
    store: &Weak<RedisBackend>,
    channel: &str,
) -> Option<redis::aio::PubSub> {
    let s = store.upgrade()?;
    let pubsub = s.conns.pubsub().await;
    drop(s);
    let subscribed = match pubsub {
        Ok(mut ps) => ps.subscribe(channel).await.map(|()| ps),
        Err(e) => Err(e),
    };
    subscribed
        .inspect_err(|e| tracing::debug!(error = %e, channel, "cannot subscribe"))
        .ok()
}

/// Calls `heard` with each message Redis publishes on `channel`, subscribed anew after a
/// broken connection, for as long as the store lives.
pub(super) async fn subscribed(
    store: Weak<RedisBackend>,
    channel: String,
    heard: impl Fn(&RedisBackend, &str),
) {
    use futures_util::StreamExt;
    while store.strong_count() > 0 {
        // The primary the Sentinels name now: a subscription made before they named another
        // is made again on it. The demoted one publishes nothing the new one is sent, and it
        // stays up (as a replica, seconds later) so its connection does not break.
        let primary = Primary::now(&store);
        let tried = tokio::time::Instant::now();
        if let Some(mut ps) = subscribe(&store, &channel).await {
            let mut messages = ps.on_message();
            let mut check = primary.checks();
            loop {
                let msg = tokio::select! {
                    msg = messages.next() => msg,
                    _ = check.tick(), if primary.named() => {
                        if primary.changed(&store) { break }
                        continue;
                    }
                };
                let Some(msg) = msg else { break };
                let Some(s) = store.upgrade() else { return };
                if let Ok(m) = msg.get_payload::<String>() {
                    heard(&s, m.as_str());
                }
            }
            if primary.changed(&store) {
                // A new primary: subscribe on it at once.
                continue;
            }
        }
        // At once after a subscription that lived (a connection the server closed, a
        // restart); no more than twice a second while Redis refuses or drops each at once.
        tokio::time::sleep_until(tried + SUBSCRIBE_AGAIN_AFTER).await;
    }
}

/// The primary a subscription was made on, when the Sentinels name it: the demoted one
/// publishes nothing the new one is sent, and stays up (a replica seconds later), so its
/// subscriptions do not break; one made before the Sentinels named another is made again.
pub(super) struct Primary(Option<u64>);

/// How often a subscription on a Sentinel-named primary checks that it is still the one.
const PRIMARY_CHECK_EVERY: Duration = Duration::from_millis(100);

impl Primary {
    /// Taken before subscribing: a switch while the subscription is made counts.
    pub(super) fn now(store: &Weak<RedisBackend>) -> Primary {
        Primary(store.upgrade().and_then(|s| {
            let generation = s.conns.generation();
            s.conns.watch.is_some().then_some(generation)
        }))
    }

    /// Whether there is a primary to check (Sentinel).
    pub(super) fn named(&self) -> bool {
        self.0.is_some()
    }

    /// Ticks every [`PRIMARY_CHECK_EVERY`], to select on while [`Primary::named`].
    pub(super) fn checks(&self) -> tokio::time::Interval {
        let mut check = tokio::time::interval(PRIMARY_CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        check
    }

    /// The Sentinels named another primary since (or the store is gone).
    pub(super) fn changed(&self, store: &Weak<RedisBackend>) -> bool {
        self.0
            .is_some_and(|g| store.upgrade().is_none_or(|s| s.conns.generation() != g))
    }
}

/// Checks a connection every [`WATCH_EVERY`] until the thread lets go of it (the returned
/// sender dropped). A node's: a `PING` that finds it closed by the server (a dropped
/// connection: redis-rs fails a call on a connection whose driver ended at once) clears
/// `open`, and the thread's next call connects anew. A Cluster's: a `PING` to every primary,
/// so that a node connection the server closed fails the `PING`, not a call, and the cluster
/// client mends it (it reconnects a node whose connection failed); `open` stays, as one dead
/// node is no reason to connect to all of them again. A slow answer proves nothing and
/// changes nothing (a call that times out forgets the connection itself). Runs on the runtime
/// that made the connection.
fn watch(mut conn: Conn, open: Arc<AtomicBool>) -> Option<tokio::sync::oneshot::Sender<()>> {
    let rt = tokio::runtime::Handle::try_current().ok()?;
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(async move {
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(WATCH_EVERY) => {}
            }
            let ping = async {
                match &mut conn {
                    Conn::Node(node) => redis::cmd("PING").query_async::<()>(node).await,
                    Conn::Cluster(cluster) => {
                        let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                        // Failed or not, the PING has done its work: the cluster client
                        // mends a node connection it found broken.
                        let _ = cluster.route_command(redis::cmd("PING"), all).await;
                        Ok(())
                    }
                }
            };
            let res = tokio::select! {
                _ = &mut stopped => return,
                res = ping => res,
            };
            if let Err(e) = res {
                if e.is_connection_dropped() {
                    tracing::debug!(error = %e, "a Redis connection was closed: the next call connects anew");
                    open.store(false, Ordering::Relaxed);
                    return;
                }
            }
        }
    });
    Some(stop)
}
