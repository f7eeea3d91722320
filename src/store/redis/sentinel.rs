//! Following a Sentinel failover as it happens, not when a connection breaks.
//!
//! A demoted primary keeps accepting writes until the Sentinels reconfigure it (about 10 s
//! after `+switch-master`), and what it accepted then is lost when it resyncs from the new
//! primary: budgets charged there are charged nowhere. So a watcher listens to every Sentinel
//! of `store.url`:
//!
//! - from a failover's start (`+try-failover`, `+selected-slave`) until the Sentinels name
//!   the new primary (`+switch-master`, or a new address when they are asked) or give up
//!   (`-failover-abort-*`), nothing is sent (the calls fail at once as [`StoreError::FailingOver`], surely not run,
//!   and `store.on_error` decides; what the `local` fallback admits is written back to the new
//!   primary). A pause lasts at most [`PAUSE_AT_MOST`];
//! - `+switch-master` makes every connection made before it stale: the next call connects
//!   again, to the primary the Sentinels name now;
//! - the primary's address is also asked of every Sentinel every [`POLL_EVERY`], in case a
//!   message was missed (a Sentinel restarted, its connection broke). Each answer comes with
//!   the config epoch the Sentinel holds it under, and the newest wins ([`newest`]): a
//!   Sentinel restarted with an old config names the primary of before a failover for a
//!   moment — still a master, taking writes it loses when it is made a replica — and is
//!   outvoted, or ignored for naming an older epoch than the watcher knows.
//!
//! Every new connection to a primary asks it `ROLE` first, and one that is not a master is
//! not used. A connection goes to the primary the watcher names, whatever the Sentinel that
//! redis-rs asked said ([`Watch::admits`]: while a failover ends, or while a restarted
//! Sentinel catches up, the Sentinels' answers differ for a moment).
//!
//! [`StoreError::FailingOver`]: crate::store::StoreError::FailingOver

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::ConnectionInfo;

/// How often the Sentinels are asked for the primary's address besides listening.
const POLL_EVERY: Duration = Duration::from_millis(500);
/// Bound on connecting to a Sentinel and subscribing (a loaded host may need more than a
/// poll's interval; while it waits, the poll still follows the primary).
const SUBSCRIBE_WITHIN: Duration = Duration::from_secs(2);
/// How long every Sentinel that answers may name an older config than the watcher knows
/// before it is followed all the same: a Sentinel restarted with an old config catches up
/// within a second or two; Sentinels set up anew start their epochs over for good.
const OLDER_FOR_GOOD_AFTER: Duration = Duration::from_secs(5);
/// Longest pause of the calls for one failover (one whose end was missed ends so).
const PAUSE_AT_MOST: Duration = Duration::from_secs(10);
/// Channels that start a pause.
const STARTS: [&str; 2] = ["+try-failover", "+selected-slave"];
/// Channels that end a pause without a new primary. Not `+failover-end` (nor
/// `-for-timeout`): the replica is promoted by then, and the Sentinel says `+switch-master`
/// only after it. Calls let through between the two went to the demoted primary, still a
/// master for seconds, and what they charged was lost with it (tests/cluster: a manual
/// failover's fallback debt, written back in that gap).
const ENDS: [&str; 3] = [
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
];
const SWITCH: &str = "+switch-master";

/// What the watcher knows, shared with every connection of the store.
#[derive(Debug)]
pub(super) struct Watch {
    /// Bumped whenever the primary changes: a connection made under an older one is stale.
    generation: AtomicU64,
    /// Ms since `epoch` when the pause began (0: none).
    paused_at_ms: AtomicU64,
    epoch: Instant,
    /// The primary as the Sentinels last named it.
    primary: Mutex<Known>,
}

/// The primary's address ("host:port"; empty: none known yet) and the config epoch the
/// Sentinels hold it under — at least: a `+switch-master` says no epoch, and counts as one
/// more than the one before. An answer naming an older epoch is a Sentinel's that has not
/// caught up: ignored. The two change together, under one lock.
#[derive(Debug, Default)]
struct Known {
    addr: String,
    epoch: u64,
}

impl Known {
    /// Notes `addr`; true when it changed from a known one (connections made to the old one
    /// are then stale).
    fn moved_to(&mut self, addr: &str) -> bool {
        if self.addr == addr {
            return false;
        }
        let changed = !self.addr.is_empty();
        self.addr = addr.to_string();
        if changed {
            tracing::warn!(primary = %self.addr, "the Sentinels named a new primary: reconnecting");
        }
        changed
    }
}

/// What one Sentinel says of the primary: its address, and the config epoch it holds it
/// under (`SENTINEL MASTER`'s `config-epoch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Named {
    pub addr: String,
    pub epoch: u64,
}

/// The answer to go by: the newest config epoch's; of equals, the primary already `known`,
/// else the first. `None` when no Sentinel answered.
fn newest<'a>(answers: &'a [Named], known: &str) -> Option<&'a Named> {
    let top = answers.iter().map(|n| n.epoch).max()?;
    let mut newest = answers.iter().filter(|n| n.epoch == top);
    let first = newest.clone().next();
    newest.find(|n| n.addr == known).or(first)
}

impl Watch {
    pub(super) fn new() -> Self {
        Watch {
            generation: AtomicU64::new(0),
            paused_at_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            primary: Mutex::new(Known::default()),
        }
    }

    /// The primary the watcher names, if it knows one.
    pub(super) fn primary(&self) -> Option<String> {
        let p = crate::store::lock(&self.primary);
        (!p.addr.is_empty()).then(|| p.addr.clone())
    }

    /// A Sentinel's answer, gone by unless it names an older config epoch than the watcher
    /// knows (a Sentinel that has not caught up with a failover): whether it was.
    pub(super) fn primary_at(&self, named: &Named) -> bool {
        self.follow(named, false)
    }

    /// Puts `named` in force (unless it is an older config and `older` does not allow it):
    /// the address and its epoch together; a new address makes older connections stale.
    fn follow(&self, named: &Named, older: bool) -> bool {
        let moved = {
            let mut p = crate::store::lock(&self.primary);
            if named.epoch < p.epoch && !older {
                tracing::debug!(primary = %named.addr, epoch = named.epoch, "a Sentinel named the primary of an older config: ignored");
                return false;
            }
            p.epoch = named.epoch;
            p.moved_to(&named.addr)
        };
        if moved {
            self.switched();
        }
        true
    }

    /// A majority of the Sentinels has named an older config than the watcher knows for
    /// [`OLDER_FOR_GOOD_AFTER`]: they were set up again (their epochs start over), not behind.
    fn epochs_started_over(&self, named: &Named) {
        tracing::warn!(primary = %named.addr, epoch = named.epoch, "the Sentinels' config epochs went back: following them");
        self.follow(named, true);
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// True while a failover is under way: send nothing.
    pub(super) fn paused(&self) -> bool {
        let at = self.paused_at_ms.load(Ordering::Acquire);
        at != 0 && self.now_ms().saturating_sub(at) < PAUSE_AT_MOST.as_millis() as u64
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    fn pause(&self) {
        if self.paused_at_ms.swap(self.now_ms(), Ordering::AcqRel) == 0 {
            tracing::warn!("the Sentinels are failing the primary over: calls wait for the new one (store.on_error decides meanwhile)");
        }
    }

    fn resume(&self) {
        self.paused_at_ms.store(0, Ordering::Release);
    }

    /// Whether a connection to `addr`, the primary a Sentinel named to a connecting thread,
    /// may be used: the watcher knows no primary yet (it notes this one), or names the same.
    /// While a failover ends the Sentinel's two answers differ: `get-master-addr-by-name` (the
    /// poll's) names the promoted replica from the moment it is promoted, `SENTINEL MASTERS`
    /// (redis-rs's, when a thread connects) the old primary until `+switch-master`. The old
    /// one is still a master then and takes writes it loses seconds later, so a connection
    /// that disagrees with the watcher is not used (the call fails unrun, `store.on_error`
    /// decides), and never moves the watcher back.
    pub(super) fn admits(&self, addr: &str) -> bool {
        let mut p = crate::store::lock(&self.primary);
        if p.addr.is_empty() {
            p.addr = addr.to_string();
        }
        p.addr == addr
    }

    /// `+switch-master` from `from` to `to`: followed when it is about the primary the
    /// watcher knows — it leaves it (a new config: one epoch more; each Sentinel says so
    /// once, and the same address again adds nothing) or names it (a poll saw it first) —
    /// or when none is known; not when it names neither (a late message about an earlier
    /// failover, or a Sentinel catching up through an intermediate config: the poll goes by
    /// the epochs). Connections made before are stale then, even when the address is the
    /// one known (the old primary came back at its address).
    fn switch(&self, from: &str, to: &str) {
        {
            let mut p = crate::store::lock(&self.primary);
            if !p.addr.is_empty() && p.addr != from && p.addr != to {
                tracing::debug!(from, to, known = %p.addr, "a switch of another primary than the one known: left to the poll");
                return;
            }
            if p.moved_to(to) {
                p.epoch += 1;
            }
        }
        self.switched();
    }

    /// Connections made before now are stale, then calls resume.
    fn switched(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.resume();
    }

    /// A message on one of the Sentinels' channels, about master `master`.
    fn event(&self, channel: &str, payload: &str, master: &str) {
        let words: Vec<&str> = payload.split_whitespace().collect();
        if channel == SWITCH {
            // `<name> <old ip> <old port> <new ip> <new port>`
            if let [name, old_ip, old_port, ip, port, ..] = words[..] {
                if name == master {
                    self.switch(&format!("{old_ip}:{old_port}"), &format!("{ip}:{port}"));
                }
            }
            return;
        }
        // `<type> <name> <ip> <port> @ <master> <ip> <port>`, or `master <name> <ip> <port>`.
        let about = match words.iter().position(|w| *w == "@") {
            Some(at) => words.get(at + 1).copied(),
            None if words.first() == Some(&"master") => words.get(1).copied(),
            None => None,
        };
        if about != Some(master) {
            return;
        }
        if STARTS.contains(&channel) {
            self.pause();
        } else if ENDS.contains(&channel) {
            self.resume();
        }
    }
}

/// Asks a freshly made connection whether it is a primary: a replica (a demoted primary
/// the Sentinels named a moment ago) is not written to.
pub(super) async fn check_role(conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(conn).await?;
    let is_master = matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master")
        || matches!(role.first(), Some(redis::Value::SimpleString(s)) if s == "master");
    if is_master {
        Ok(())
    } else {
        Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "the node the Sentinels named is not a primary (yet)",
        )))
    }
}

/// Watches `sentinels` for failovers of `master` on a thread of its own, until `watch` is
/// dropped.
pub(super) fn spawn_watcher(sentinels: Vec<ConnectionInfo>, master: String, watch: Weak<Watch>) {
    let spawned = crate::background::spawn("tollgate-sentinel".into(), move || async move {
        let mut tasks = tokio::task::JoinSet::new();
        for s in sentinels.clone() {
            tasks.spawn(listen(s, master.clone(), watch.clone()));
        }
        tasks.spawn(poll(sentinels, master, watch));
        while tasks.join_next().await.is_some() {}
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot watch the Sentinels; a failover is followed when connections break");
    }
}

/// Listens to one Sentinel's failover channels, reconnecting while the store lives.
async fn listen(sentinel: ConnectionInfo, master: String, watch: Weak<Watch>) {
    use futures_util::StreamExt;
    let channels: Vec<&str> = STARTS
        .iter()
        .chain(&ENDS)
        .chain([&SWITCH])
        .copied()
        .collect();
    loop {
        if watch.strong_count() == 0 {
            return;
        }
        let subscribed = async {
            let client = redis::Client::open(sentinel.clone())?;
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&channels).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(SUBSCRIBE_WITHIN, subscribed).await {
            Ok(Ok(mut ps)) => {
                let mut messages = ps.on_message();
                while let Some(msg) = messages.next().await {
                    let Some(w) = watch.upgrade() else { return };
                    if let Ok(payload) = msg.get_payload::<String>() {
                        w.event(msg.get_channel_name(), &payload, &master);
                    }
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot listen to a Sentinel"),
            Err(_) => tracing::debug!("a Sentinel did not answer the subscription"),
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Asks every Sentinel for the primary every [`POLL_EVERY`], on a connection kept to each,
/// and goes by the newest config's answer.
async fn poll(sentinels: Vec<ConnectionInfo>, master: String, watch: Weak<Watch>) {
    let mut conns: Vec<Option<MultiplexedConnection>> = vec![None; sentinels.len()];
    // Since when a majority of the Sentinels has named an older config than the watcher
    // knows, poll after poll.
    let mut older_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(POLL_EVERY).await;
        let Some(w) = watch.upgrade() else { return };
        let answers = answers_on(&mut conns, &sentinels, &master, POLL_EVERY).await;
        let Some(n) = newest(&answers, &w.primary().unwrap_or_default()) else {
            older_since = None;
            continue;
        };
        // Only a majority naming an older config is the Sentinels' word: one that alone
        // answers may be behind (restarted, or with the old primary on a partition's far
        // side).
        if w.primary_at(n) || answers.len() * 2 <= sentinels.len() {
            older_since = None;
        } else if older_since.get_or_insert_with(Instant::now).elapsed() >= OLDER_FOR_GOOD_AFTER {
            w.epochs_started_over(n);
            older_since = None;
        }
    }
}

/// Every Sentinel's answer now, on connections of their own (a connection's first: rare),
/// and the newest config's of them.
pub(super) async fn ask_every(
    sentinels: &[ConnectionInfo],
    master: &str,
    within: Duration,
) -> Option<Named> {
    let mut conns = vec![None; sentinels.len()];
    let answers = answers_on(&mut conns, sentinels, master, within).await;
    newest(&answers, "").cloned()
}

/// The answers of the Sentinels that answer within `within`, asked at once, each on its
/// connection in `conns` (made first where there is none; dropped when it fails).
async fn answers_on(
    conns: &mut [Option<MultiplexedConnection>],
    sentinels: &[ConnectionInfo],
    master: &str,
    within: Duration,
) -> Vec<Named> {
    let asked = conns.iter_mut().zip(sentinels).map(|(conn, s)| async {
        let answer = tokio::time::timeout(within, ask_on(conn, s, master)).await;
        let answer = answer.unwrap_or_else(|_| Err((redis::ErrorKind::Io, "no answer").into()));
        if answer.is_err() {
            *conn = None;
        }
        answer.ok().flatten()
    });
    futures_util::future::join_all(asked)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// One Sentinel's answer (connecting first if `conn` is none): the primary's address as
/// `get-master-addr-by-name` gives it (while a failover ends, the promoted replica already),
/// with `SENTINEL MASTER`'s `config-epoch` (a map under RESP3, pairs in an array under RESP2:
/// read as a map either way). `None`: it knows no such master (asked apart: `SENTINEL MASTER`
/// of an unknown master is an error reply).
async fn ask_on(
    conn: &mut Option<MultiplexedConnection>,
    sentinel: &ConnectionInfo,
    master: &str,
) -> redis::RedisResult<Option<Named>> {
    if conn.is_none() {
        let client = redis::Client::open(sentinel.clone())?;
        *conn = Some(client.get_multiplexed_async_connection().await?);
    }
    let Some(c) = conn.as_mut() else {
        return Ok(None);
    };
    let addr: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(master)
        .query_async(c)
        .await?;
    let Some((ip, port)) = addr else {
        return Ok(None);
    };
    let fields: std::collections::HashMap<String, String> = redis::cmd("SENTINEL")
        .arg("master")
        .arg(master)
        .query_async(c)
        .await?;
    let epoch = fields
        .get("config-epoch")
        .and_then(|e| e.parse().ok())
        .unwrap_or(0);
    Ok(Some(Named {
        addr: format!("{ip}:{port}"),
        epoch,
    }))
}

#[cfg(test)]
mod tests;
