//! The batch exporter: finished spans go into a bounded queue, and a thread of their own
//! sends them to the collector in batches — never the request's thread, never one of
//! Pingora's runtimes (they come and go with the service).
//!
//! Why not the SDK's `BatchSpanProcessor`: it has the same shape (a bounded queue and a
//! thread) but keeps the number of spans it drops to itself (it logs it at shutdown). Here
//! every span that does not reach the collector — the queue was full, or its batch failed —
//! is counted in `tollgate_trace_spans_dropped_total`, which is what an SRE alerts on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use prometheus::IntCounter;

/// How many finished spans may wait for export; beyond, new ones are dropped (and counted).
const QUEUE: usize = 4096;
/// Spans per export request.
const BATCH: usize = 512;
/// A span waits at most this long for its batch to fill.
const DELAY: Duration = Duration::from_millis(500);

enum Msg {
    Span(Box<SpanData>),
    /// Export what is queued, then answer.
    Flush(SyncSender<()>),
}

/// The span processor of the gateway's tracer provider.
#[derive(Debug)]
pub struct Exporting {
    queue: SyncSender<Msg>,
    dropped: IntCounter,
    stopping: Arc<AtomicBool>,
}

impl Exporting {
    /// Starts the export thread with `exporter` (its resource already set).
    pub fn start<E: SpanExporter + 'static>(
        exporter: E,
        dropped: IntCounter,
    ) -> std::io::Result<Exporting> {
        let (queue, rx) = mpsc::sync_channel(QUEUE);
        let stopping = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            exporter,
            dropped: dropped.clone(),
            stopping: stopping.clone(),
            failing: false,
        };
        std::thread::Builder::new()
            .name("trace-export".into())
            .spawn(move || worker.run(rx))?;
        Ok(Exporting {
            queue,
            dropped,
            stopping,
        })
    }

    /// Sends `msg` and waits up to `timeout` for the export thread's answer.
    fn ask(&self, timeout: Duration) -> OTelSdkResult {
        let (done, answered) = mpsc::sync_channel(1);
        match self.queue.try_send(Msg::Flush(done)) {
            Ok(()) => answered
                .recv_timeout(timeout)
                .map_err(|_| OTelSdkError::Timeout(timeout)),
            // A full queue: the thread is busy exporting and will not be told in time.
            Err(_) => Err(OTelSdkError::Timeout(timeout)),
        }
    }
}

impl SpanProcessor for Exporting {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        // Never waits: a full queue (a slow or dead collector) costs the span, not the request.
        match self.queue.try_send(Msg::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => self.dropped.inc(),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.ask(Duration::from_secs(5))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let r = self.ask(timeout);
        self.stopping.store(true, Ordering::Relaxed);
        r
    }
}

struct Worker<E> {
    exporter: E,
    dropped: IntCounter,
    stopping: Arc<AtomicBool>,
    /// The last export failed (logged once per run of failures, not per batch).
    failing: bool,
}

impl<E: SpanExporter> Worker<E> {
    fn run(mut self, rx: Receiver<Msg>) {
        let mut batch: Vec<SpanData> = Vec::with_capacity(BATCH);
        let mut due = Instant::now() + DELAY;
        while !self.stopping.load(Ordering::Relaxed) {
            let wait = due.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Msg::Span(span)) => {
                    if batch.is_empty() {
                        due = Instant::now() + DELAY;
                    }
                    batch.push(*span);
                    if batch.len() >= BATCH {
                        self.export(&mut batch);
                    }
                }
                Ok(Msg::Flush(done)) => {
                    self.export(&mut batch);
                    let _ = done.try_send(());
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.export(&mut batch);
                    due = Instant::now() + DELAY;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.export(&mut batch);
                    return;
                }
            }
        }
    }

    fn export(&mut self, batch: &mut Vec<SpanData>) {
        if batch.is_empty() {
            return;
        }
        let spans = std::mem::replace(batch, Vec::with_capacity(BATCH));
        let n = spans.len() as u64;
        // The HTTP client is a blocking one (it has its own thread): the future is ready when
        // the collector has answered or the exporter's timeout has passed.
        match futures_executor::block_on(self.exporter.export(spans)) {
            Ok(()) => {
                if std::mem::take(&mut self.failing) {
                    tracing::info!("trace export works again");
                }
            }
            Err(e) => {
                self.dropped.inc_by(n);
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(error = %e, spans = n, "trace export failed; spans are dropped (tollgate_trace_spans_dropped_total) until it works again");
                }
            }
        }
    }
}
