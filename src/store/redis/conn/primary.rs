//! Connections to the primary a Sentinel group names (`store.url` `redis+sentinel://`):
//! straight to the one the watcher (`super::sentinel`) names once redis-rs has made a first
//! connection, with that connection's settings.

use redis::ConnectionInfo;

use super::{address, sentinel, Connections, Target};
use redis::sentinel::Sentinel;

impl Connections {
    /// A client for the primary the watcher names. redis-rs asks the Sentinels in turn and
    /// takes the first answer, which may name another: while a failover ends, or from a
    /// Sentinel restarted with an old config (the primary of before the failover, still a
    /// master for seconds, which loses what it takes). The watcher goes by the newest config
    /// (`sentinel::newest`), asking every Sentinel itself before the first connection; the
    /// connection goes there, with redis-rs's settings (TLS, password, database).
    pub(super) async fn known_primary(&self, target: &Target) -> redis::RedisResult<redis::Client> {
        let (
            Some(watch),
            Target::Sentinel {
                sentinels, master, ..
            },
        ) = (&self.watch, target)
        else {
            return primary_client(target).await;
        };
        // Once redis-rs has made one: straight to the primary the watcher names, without
        // asking a Sentinel (whose answer would not count, and which may name none while
        // the Sentinels reconfigure after a failover).
        let settings = crate::store::lock(&self.settings).clone();
        if let (Some(primary), Some(settings)) = (watch.primary(), settings) {
            return redirected(settings, &primary);
        }
        let client = primary_client(target).await?;
        *crate::store::lock(&self.settings) = Some(client.get_connection_info().clone());
        if watch.primary().is_none() {
            if let Some(n) = sentinel::ask_every(sentinels, master, self.connect_timeout).await {
                watch.primary_at(&n);
            }
        }
        let named = address(client.get_connection_info());
        if watch.admits(&named) {
            return Ok(client);
        }
        match watch.primary() {
            Some(primary) => redirected(client.get_connection_info().clone(), &primary),
            None => Ok(client),
        }
    }
}

/// A client for the primary the Sentinels name now. A Sentinel client of its own for each
/// connect: it keeps connections to the Sentinels, which must not outlive this runtime's use
/// of them.
async fn primary_client(target: &Target) -> redis::RedisResult<redis::Client> {
    let Target::Sentinel {
        sentinels,
        master,
        primary,
    } = target
    else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "not a Sentinel target",
        )));
    };
    let mut sentinel = Sentinel::build(sentinels.clone())?;
    sentinel.async_master_for(master, Some(primary)).await
}

/// A client with the connection settings `info` (TLS, password, database), to `addr`
/// ("host:port") instead.
fn redirected(info: ConnectionInfo, addr: &str) -> redis::RedisResult<redis::Client> {
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "the Sentinels named no usable address",
                addr.to_string(),
            ))
        })?;
    let mut to = info.addr().clone();
    match &mut to {
        redis::ConnectionAddr::Tcp(h, p)
        | redis::ConnectionAddr::TcpTls {
            host: h, port: p, ..
        } => {
            (*h, *p) = (host, port);
        }
        _ => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a Sentinel's primary is reached over TCP",
            )))
        }
    }
    redis::Client::open(info.set_addr(to))
}
