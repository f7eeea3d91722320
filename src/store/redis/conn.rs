//! Connections to Redis: one multiplexed connection per worker thread, made lazily.
//!
//! A redis-rs connection's driver task runs on the runtime that created it, and each Pingora
//! worker is a current-thread runtime of its own: so each thread connects on first use (on its
//! own runtime), concurrent requests on it share that one socket, and a connection that failed
//! or timed out is dropped and made again on the next call. Connecting lazily is also what
//! lets the gateway start while Redis is down.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

use crate::store::StoreError;

thread_local! {
    /// This thread's connection: (connections id, connection).
    static CONN: RefCell<Option<(u64, MultiplexedConnection)>> = const { RefCell::new(None) };
    /// Held while this thread connects, so concurrent requests wait for one connection
    /// instead of each opening their own.
    static CONNECTING: Arc<tokio::sync::Mutex<()>> = Arc::new(tokio::sync::Mutex::new(()));
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// How to reach one Redis; tells its thread-local connections apart from another store's.
pub(super) struct Connections {
    id: u64,
    client: Result<redis::Client, String>,
    config: AsyncConnectionConfig,
    /// Bound on making a connection: `max(store.timeout, 100ms)`, since a TCP (and TLS)
    /// handshake needs more than a call.
    connect_timeout: Duration,
}

impl Connections {
    /// `response_timeout` bounds how long a reply is awaited on the connection itself; calls
    /// are bounded by `store.timeout` by their callers.
    pub(super) fn new(url: &str, timeout: Duration, response_timeout: Duration) -> Self {
        let client = redis::Client::open(url).map_err(|e| e.to_string());
        if let Err(e) = &client {
            tracing::error!(error = %e, "store.url is not usable; running on store.on_error");
        }
        let connect_timeout = timeout.max(Duration::from_millis(100));
        Connections {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            client,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(Some(response_timeout)),
            connect_timeout,
        }
    }

    fn cached(&self) -> Option<MultiplexedConnection> {
        CONN.with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(id, _)| *id == self.id)
                .map(|(_, conn)| conn.clone())
        })
    }

    /// This thread's connection, made on first use (on this thread's runtime).
    pub(super) async fn get(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let client = self
            .client
            .as_ref()
            .map_err(|e| StoreError::Config(e.clone()))?;
        let lock = CONNECTING.with(|l| l.clone());
        tokio::time::timeout(self.connect_timeout, async {
            let _one_at_a_time = lock.lock().await;
            if let Some(c) = self.cached() {
                return Ok(c);
            }
            let conn = client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await
                .map_err(StoreError::Connect)?;
            CONN.with(|c| *c.borrow_mut() = Some((self.id, conn.clone())));
            Ok(conn)
        })
        .await
        .map_err(|_| StoreError::ConnectTimeout)?
    }

    /// A timed-out or broken connection is not trusted again: the next call connects anew.
    pub(super) fn forget(&self) {
        CONN.with(|c| {
            let mut c = c.borrow_mut();
            if c.as_ref().is_some_and(|(id, _)| *id == self.id) {
                *c = None;
            }
        });
    }
}
