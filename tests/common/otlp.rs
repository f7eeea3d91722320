//! An OTLP/HTTP collector for the tests: it decodes each `POST /v1/traces` body as the
//! protobuf `ExportTraceServiceRequest` (opentelemetry-proto's types) and keeps the spans;
//! and a collector that accepts connections and never answers.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
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

use super::wait::eventually;
use super::BackgroundRuntime;

/// A received span and the `service.name` of its resource.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

impl Received {
    pub fn name(&self) -> &str {
        &self.span.name
    }

    pub fn trace_id(&self) -> String {
        hex::encode(&self.span.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex::encode(&self.span.span_id)
    }

    pub fn parent_id(&self) -> String {
        hex::encode(&self.span.parent_span_id)
    }

    /// The attribute `key` as text (strings as they are, numbers in decimal).
    pub fn attr(&self, key: &str) -> Option<String> {
        let kv = self.span.attributes.iter().find(|kv| kv.key == key)?;
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            Value::BoolValue(b) => Some(b.to_string()),
            Value::DoubleValue(d) => Some(d.to_string()),
            other => Some(format!("{other:?}")),
        }
    }

    /// Every attribute value, as text (to look for what must never be there).
    pub fn all_values(&self) -> String {
        format!("{:?}", self.span.attributes)
    }
}

pub struct Collector {
    pub port: u16,
    spans: Arc<Mutex<Vec<Received>>>,
    _rt: BackgroundRuntime,
}

impl Collector {
    pub fn start() -> Collector {
        let rt = BackgroundRuntime::new(1);
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        let port = rt.serve(move |l| async move {
            loop {
                let Ok((stream, _)) = l.accept().await else {
                    continue;
                };
                let kept = kept.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| receive(req, kept.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Collector {
            port,
            spans,
            _rt: rt,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until spans of trace `trace_id` named `names` arrived (a name given twice: at
    /// least two such spans).
    pub async fn wait_trace(&self, trace_id: &str, names: &[&str]) -> Vec<Received> {
        eventually(Duration::from_secs(15), async || {
            let of_trace: Vec<Received> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id() == trace_id)
                .collect();
            let arrived = names.iter().all(|n| {
                let wanted = names.iter().filter(|m| *m == n).count();
                of_trace.iter().filter(|s| s.name() == *n).count() >= wanted
            });
            match arrived {
                true => Ok(of_trace),
                false => Err(format!(
                    "trace {trace_id}: wanted spans {names:?}, got {of_trace:#?}"
                )),
            }
        })
        .await
    }
}

async fn receive(
    req: Request<hyper::body::Incoming>,
    kept: Arc<Mutex<Vec<Received>>>,
) -> Result<Response<Full<bytes::Bytes>>, Infallible> {
    let path_ok = req.uri().path() == "/v1/traces";
    let proto = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/x-protobuf");
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let Ok(export) = ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string()) else {
        return Ok(Response::builder()
            .status(400)
            .body(Full::default())
            .unwrap());
    };
    if !(path_ok && proto) {
        return Ok(Response::builder()
            .status(404)
            .body(Full::default())
            .unwrap());
    }
    let mut spans = kept.lock().unwrap();
    for rs in export.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for span in ss.spans {
                spans.push(Received {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    Ok(Response::builder()
        .header("content-type", "application/x-protobuf")
        .body(Full::new(answer.into()))
        .unwrap())
}

/// A collector that accepts connections and reads them, and never answers.
pub struct BlackHole {
    pub port: u16,
    _rt: BackgroundRuntime,
}

impl BlackHole {
    pub fn start() -> BlackHole {
        let rt = BackgroundRuntime::new(1);
        let port = rt.serve(|l| async move {
            let mut held = Vec::new();
            loop {
                if let Ok((stream, _)) = l.accept().await {
                    // Kept open, unread beyond the socket buffer, never answered.
                    held.push(stream);
                }
            }
        });
        BlackHole { port, _rt: rt }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}
