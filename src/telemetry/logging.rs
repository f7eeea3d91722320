//! Logging: tracing-subscriber (JSON or pretty, `RUST_LOG`), written by a background thread,
//! with Pingora's `log` records bridged in. The access log has a writer of its own
//! ([`super::access`]), in the same formats and under the same filter.

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Pretty,
}

/// Keeps the log writer's background thread alive; taken by [`flush_logs`].
static LOG_GUARD: std::sync::Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> =
    std::sync::Mutex::new(None);

/// Installs the tracing subscriber (`RUST_LOG` filter, default `info`) and bridges the `log`
/// records that Pingora writes into it ([`PingoraLog`]). Lines are written to stderr by a background thread, so
/// a request never waits on the log (the access log at `info` cost 16 % of throughput when
/// written in place); if that thread falls 128k lines behind, lines are dropped, not waited for.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    // The writer thread drains every line that is waiting and then flushes: buffered, a busy
    // gateway's log costs one write(2) per batch instead of one per line.
    let (writer, guard) = tracing_appender::non_blocking(std::io::BufWriter::with_capacity(
        64 * 1024,
        std::io::stderr(),
    ));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Pingora's `log` records below this level are not even built (nor, ever, its debug and
    // trace records: `PingoraLog`).
    let log_level = {
        use tracing_log::AsLog;
        filter
            .max_level_hint()
            .map(|l| l.as_log())
            .unwrap_or(log::LevelFilter::Trace)
            .min(log::LevelFilter::Info)
    };
    // Coloured only for a person at a terminal: not into a file, a pipe or journald, whose
    // readers would get the escape codes as text; nor with NO_COLOR (https://no-color.org).
    // Decided here once so that the access log's pretty lines are coloured exactly when the
    // other lines are.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var("NO_COLOR").map_or(true, |v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    let installed = match format {
        LogFormat::Json => {
            tracing::subscriber::set_global_default(builder.json().flatten_event(true).finish())
        }
        LogFormat::Pretty => tracing::subscriber::set_global_default(builder.compact().finish()),
    };
    if installed.is_ok() {
        if log::set_boxed_logger(Box::new(PingoraLog)).is_ok() {
            log::set_max_level(log_level);
        }
        if let Ok(mut g) = LOG_GUARD.lock() {
            *g = Some(guard);
        }
        super::access::install(format == LogFormat::Json, ansi);
    }
}

/// Bridges Pingora's `log` records into tracing, with two changes: the errors Pingora logs
/// for a client that went away, timed out, failed its handshake or framed its body wrongly —
/// which no hook can suppress — are debug events (a client that leaves or sends garbage is not
/// a gateway error: its access-log line says what happened, and a client must not be able to
/// fill the error log at will), and so is the
/// one for a pooled upstream connection it could not reuse (it connects anew); and its own
/// debug and trace records are dropped, whatever `RUST_LOG` says: they print request heads
/// whole, API keys and bearer tokens with them.
struct PingoraLog;

/// Parts of the messages of those records (pingora-proxy and pingora-core 0.9).
const CLIENT_GONE: [&str; 9] = [
    "Downstream InvalidChunk",
    "Downstream InvalidTrailerEnd",
    "Downstream ConnectionClosed",
    "Downstream ReadError",
    "Downstream WriteError",
    "Downstream ReadTimedout",
    "Downstream WriteTimedout",
    "finish sending body to downstream",
    "failed to send error response to downstream",
];

fn is_client_gone(message: &str) -> bool {
    CLIENT_GONE.iter().any(|m| message.contains(m))
        || message.starts_with("Downstream handshake")
        || message.starts_with("H2 handshake error")
        // A pooled upstream connection lost a race with its idle watcher: Pingora connects
        // anew and the request is not affected (pingora-core connectors/mod.rs).
        || message == "failed to acquire reusable stream"
}

/// redis-rs's own warnings and notes: while a Cluster node is down it says, many times a
/// second, that it failed to connect and refreshes its slots. The store's failures are
/// tollgate's to log, with their cause and rate-limited by the breaker: redis-rs's go to
/// debug (its errors stay).
fn is_redis_chatter(record: &log::Record) -> bool {
    record.level() > log::Level::Error
        && (record.target() == "redis" || record.target().starts_with("redis::"))
}

impl log::Log for PingoraLog {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let quieted = (record.level() == log::Level::Error
            && is_client_gone(&record.args().to_string()))
            || is_redis_chatter(record);
        if quieted {
            let _ = tracing_log::format_trace(
                &log::Record::builder()
                    .args(*record.args())
                    .level(log::Level::Debug)
                    .target(record.target())
                    .module_path(record.module_path())
                    .file(record.file())
                    .line(record.line())
                    .build(),
            );
        } else {
            let _ = tracing_log::format_trace(record);
        }
    }

    fn flush(&self) {}
}

/// How long an exit waits for the access log to be written out: a stalled stderr (a full
/// pipe to a log shipper that stopped reading) must not keep the process from exiting.
const FLUSH_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Writes out every buffered log line, waiting at most [`FLUSH_WITHIN`] for the access log.
/// Call before the process exits.
pub fn flush_logs() {
    let (done, wait) = std::sync::mpsc::channel();
    let flushing = std::thread::Builder::new()
        .name("log-flush".into())
        .spawn(move || {
            super::access::flush();
            let _ = done.send(());
        });
    if flushing.is_ok() {
        let _ = wait.recv_timeout(FLUSH_WITHIN);
    }
    let guard = LOG_GUARD.lock().ok().and_then(|mut g| g.take());
    drop(guard);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_gone_records_are_recognised() {
        // The texts pingora-proxy 0.9 logs (pingora-error's Display: "<source> <type> context: ...").
        assert!(is_client_gone(
            "Fail to proxy: Downstream ConnectionClosed context: while reading request headers, bytes already read, status: 0"
        ));
        assert!(is_client_gone(
            "Error finish sending body to downstream: Downstream WriteError"
        ));
        assert!(is_client_gone(
            "Downstream handshake error from 127.0.0.1:5555"
        ));
        assert!(is_client_gone("failed to acquire reusable stream"));
        assert!(is_client_gone(
            "Fail to proxy: Downstream InvalidChunk context: Invalid chunked encoding"
        ));
        assert!(!is_client_gone("Fail to proxy: Upstream ConnectRefused"));
    }

    /// redis-rs's warnings and notes go to debug; its errors, and other crates', stay.
    #[test]
    fn redis_chatter_is_quieted() {
        let record = |target: &'static str, level| {
            let args = format_args!("Failed to connect to node");
            is_redis_chatter(
                &log::Record::builder()
                    .args(args)
                    .target(target)
                    .level(level)
                    .build(),
            )
        };
        assert!(record("redis::cluster_async", log::Level::Warn));
        assert!(record("redis", log::Level::Info));
        assert!(!record("redis::cluster_async", log::Level::Error));
        assert!(!record("redis_x", log::Level::Warn));
        assert!(!record("pingora_core::connectors", log::Level::Warn));
    }
}
