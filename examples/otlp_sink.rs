//! A local OTLP/HTTP receiver for trying `tracing:` without a collector: it answers every
//! `POST /v1/traces` with 200 and prints each span it decodes, one line per span.
//!
//! `cargo run --example otlp_sink [ADDR]` (default `127.0.0.1:4318`); `--quiet` prints only
//! a count of the spans received, every 5 s.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

fn line(s: &Span) -> String {
    let attrs: Vec<String> = s
        .attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => format!("{s:?}"),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(other) => format!("{other:?}"),
                None => "-".into(),
            };
            format!("{}={v}", kv.key)
        })
        .collect();
    let ms = s.end_time_unix_nano.saturating_sub(s.start_time_unix_nano) as f64 / 1e6;
    format!(
        "trace={} span={} parent={} {:?} {ms:.3}ms {}",
        hex::encode(&s.trace_id),
        hex::encode(&s.span_id),
        if s.parent_span_id.is_empty() {
            "-".into()
        } else {
            hex::encode(&s.parent_span_id)
        },
        s.name,
        attrs.join(" ")
    )
}

async fn receive(
    req: Request<hyper::body::Incoming>,
    quiet: bool,
    count: Arc<AtomicU64>,
) -> Result<Response<Full<bytes::Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if let Ok(export) = ExportTraceServiceRequest::decode(body) {
        for span in export
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| &s.spans)
        {
            count.fetch_add(1, Ordering::Relaxed);
            if !quiet {
                println!("{}", line(span));
            }
        }
    }
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    Ok(Response::new(Full::new(answer.into())))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quiet = args.iter().any(|a| a == "--quiet");
    let addr = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or("127.0.0.1:4318", |a| a.as_str());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("otlp_sink: listening on http://{addr}/v1/traces");
    let count = Arc::new(AtomicU64::new(0));
    if quiet {
        let c = count.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                println!("spans received: {}", c.load(Ordering::Relaxed));
            }
        });
    }
    loop {
        let (stream, _) = listener.accept().await?;
        let count = count.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| receive(req, quiet, count.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
