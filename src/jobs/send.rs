//! A job's request to the upstream, and the answer read back whole (up to
//! `max_response_body`): the peer the synchronous path would pick, with the same timeouts
//! (`upstreams::peer`), through Pingora's own client.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;

use super::Stored;
use crate::route::stated::Report;
use crate::route::Route;
use crate::state::Running;
use crate::trace::{JobTrace, Tracing};
use crate::upstreams;

/// What the upstream receives: the head as `forward::request` made it at submission, and the
/// whole body.
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub header: RequestHeader,
    pub body: Bytes,
}

/// The trace of a job's access-log lines while tracing is on (`traced`): the one its request's
/// `traceparent` names, the submission's (DESIGN §5: the trace id when tracing is on).
pub(crate) fn trace_of(traced: bool, headers: &http::HeaderMap) -> Option<crate::trace::TraceHex> {
    let value = headers.get("traceparent").filter(|_| traced)?;
    crate::trace::TraceHex::of_traceparent(value.as_bytes())
}

/// How sending went.
pub(super) enum Sent {
    /// The upstream answered in full.
    Answer {
        stored: Stored,
        upstream: Duration,
        report: Option<Report>,
    },
    /// It never had the request (no connection, or the request could not be written): 502,
    /// refunded, as for a synchronous request.
    Unreachable(Unreachable),
    /// No answer within `read_timeout`: 504, charged. The slot follows the late answer.
    TimedOut(Box<Follow>),
    /// An answer over `max_response_body`: 502, charged.
    TooLarge { upstream: Duration },
    /// The answer broke off, or the upstream closed the connection before its head, having
    /// read the request (`upstreams::had_request`): 502, charged (the upstream had it).
    Broken { upstream: Duration, detail: String },
}

/// The job's result's detail for [`Sent::Broken`].
pub(crate) const BROKEN: &str =
    "the upstream closed the connection before its answer was whole; it had the request, so the charge stands";

/// Why the upstream never had a job's request (logged with the job's 502).
#[derive(Debug, thiserror::Error)]
pub(super) enum Unreachable {
    #[error("no healthy address in the named upstream")]
    NoHealthyAddress,
    #[error("upstream host did not resolve")]
    Unresolved,
    /// Connecting, writing the request or reading the answer's head failed.
    #[error(transparent)]
    Io(#[from] Box<pingora::Error>),
    #[error("no response head")]
    NoHead,
}

/// The upstream connection of a job that timed out: read to the end of its late answer (and
/// discarded) so that the route's slot follows the upstream's work, until `deadline`
/// (`abandon_timeout` after the request was sent).
pub(super) struct Follow {
    session: HttpSession,
    deadline: Instant,
}

/// What a followed late answer tells of its job's charge, as for a synchronous 504's
/// (`proxy/late.rs`): the upstream's time to the answer's head, and the cost it stated.
pub(super) struct LateTold {
    /// To the head; when no head came, until following ended (the upstream closed without
    /// one, or `abandon_timeout` came): it held the slot that long, as for a synchronous 504.
    pub upstream: Duration,
    pub report: Option<Report>,
}

impl Follow {
    /// Follows the late answer to its end; `sent`: when the job went to the upstream,
    /// `timed_out`: its time at the timeout.
    pub(super) async fn until_done(
        mut self,
        route: &Route,
        sent: Instant,
        timed_out: Duration,
    ) -> LateTold {
        let s = &mut self.session;
        let mut head_at = None;
        let read = async {
            read_head(s).await?;
            head_at = Some(Instant::now());
            while s.read_response_body().await?.is_some() {}
            Ok::<(), Box<pingora::Error>>(())
        };
        let _ = tokio::time::timeout_at(self.deadline.into(), read).await;
        let report = match (
            head_at,
            &route.fidelity.cost_from_response,
            s.response_header(),
        ) {
            (Some(_), Some(name), Some(head)) => {
                Some(Report::read(&head.headers, name, route.cost))
            }
            _ => None,
        };
        LateTold {
            upstream: match head_at {
                Some(at) => at.saturating_duration_since(sent),
                // Following ended now, or (when its caller came late) at the deadline.
                None => Instant::now()
                    .min(self.deadline)
                    .saturating_duration_since(sent)
                    .max(timed_out),
            },
            report,
        }
    }
}

/// One connector for every job: its sessions are never put back in its pool (a pooled
/// connection would belong to the runtime of the job that opened it).
fn connector() -> &'static Connector {
    static C: OnceLock<Connector> = OnceLock::new();
    C.get_or_init(|| Connector::new(None))
}

/// The headers of a stored answer: hop-by-hop ones and the length (set again when it is
/// served) are left out.
fn kept(name: &http::HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-connection"
            | "content-length"
    )
}

/// The peer for `route`, as `upstream_peer` picks it, with the `Host` of a named upstream's
/// address, its read timeout and abandon timeout.
type PeerChoice = (
    pingora::upstreams::peer::HttpPeer,
    Option<http::HeaderValue>,
    Duration,
    Duration,
);

/// (`refused`: the named pool's addresses that refused this job's connection.)
fn peer(
    running: &Running,
    route: &Route,
    refused: &[std::net::SocketAddr],
) -> Result<PeerChoice, Unreachable> {
    if let Some(name) = &route.provider.upstream {
        let (addr, t) = running
            .pools
            .get(name)
            .and_then(|p| p.pick(refused))
            .ok_or(Unreachable::NoHealthyAddress)?;
        let host = Some(t.host_header.clone());
        return Ok((
            upstreams::peer(addr, t),
            host,
            t.read_timeout,
            t.abandon_timeout,
        ));
    }
    let addr = running.upstream_addr.ok_or(Unreachable::Unresolved)?;
    let up = &running.config.upstream;
    Ok((
        upstreams::peer(addr, up),
        None,
        up.read_timeout,
        up.abandon_timeout,
    ))
}

/// A connection to the route's upstream with the job's request written on it.
struct Opened {
    session: HttpSession,
    /// How soon a close without an answer means the upstream never read the request
    /// (`upstreams::stale_within`).
    within: Duration,
    sent_at: Instant,
    read_timeout: Duration,
    abandon: Duration,
}

/// Connects and writes the request (its head, and `req`'s body; with `trace`, named in its
/// `traceparent` once connected); `Err` when the upstream never had it.
async fn open(
    running: &Running,
    route: &Route,
    req: &JobRequest,
    trace: Option<(&Tracing, &mut JobTrace)>,
) -> Result<Opened, Unreachable> {
    // An address of a named pool that refuses the connection is not tried again: the next
    // one is (the upstream never had the job), as `fail_to_connect` does for a request.
    let mut refused = Vec::new();
    let (mut s, peer, host, read_timeout, abandon) = loop {
        let (peer, host, read_timeout, abandon) = peer(running, route, &refused)?;
        match connector().get_http_session(&peer).await {
            Ok((s, _)) => break (s, peer, host, read_timeout, abandon),
            Err(e) => {
                let name = route.provider.upstream.as_deref();
                if !running.pools.refused(name, &peer, &mut refused) {
                    return Err(e.into());
                }
            }
        }
    };
    let mut header = req.header.clone();
    if let Some(h) = host {
        header.insert_header(http::header::HOST, h)?;
    }
    // A new connection every time (the connector pools none): its round trip is known.
    upstreams::note_round_trip(&peer._address, s.digest());
    let within = upstreams::stale_within(&peer._address);
    if let Some((tracing, trace)) = trace {
        trace.upstream_request(tracing, &mut header);
    }
    // Reads are timed here (a timed-out read is then followed, see `Follow`).
    s.set_read_timeout(None);
    s.set_write_timeout(Some(read_timeout));
    let sent_at = Instant::now();
    s.write_request_header(Box::new(header)).await?;
    if !req.body.is_empty() {
        s.write_request_body(req.body.clone(), false).await?;
    }
    s.finish_request_body().await?;
    Ok(Opened {
        session: s,
        within,
        sent_at,
        read_timeout,
        abandon,
    })
}

/// The TCP state of the session's connection, now (a job's is always a new one).
fn tcp_info(s: &HttpSession) -> Option<pingora::protocols::l4::ext::TCP_INFO> {
    s.digest()?.socket_digest.as_ref()?.tcp_info()
}

/// Reads the answer's head, past informational ones (103 Early Hints).
async fn read_head(s: &mut HttpSession) -> pingora::Result<()> {
    loop {
        s.read_response_header().await?;
        let informational = s
            .response_header()
            .is_some_and(|h| h.status.is_informational() && h.status != 101);
        if !informational {
            return Ok(());
        }
    }
}

/// Why an answer's body was not kept.
enum BodyError {
    TooLarge,
    Broken(String),
}

/// The whole body, at most `max` bytes, each read within `read_timeout`.
async fn read_body(
    s: &mut HttpSession,
    max: u64,
    read_timeout: Duration,
) -> Result<Bytes, BodyError> {
    let declared = s
        .response_header()
        .and_then(|h| h.headers.get(http::header::CONTENT_LENGTH))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(BodyError::TooLarge);
    }
    let mut body = BytesMut::new();
    loop {
        match tokio::time::timeout(read_timeout, s.read_response_body()).await {
            Ok(Ok(Some(chunk))) => {
                if (body.len() + chunk.len()) as u64 > max {
                    return Err(BodyError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(Ok(None)) => return Ok(body.freeze()),
            Ok(Err(e)) => return Err(BodyError::Broken(e.to_string())),
            Err(_) => {
                return Err(BodyError::Broken(
                    "the answer stalled past read_timeout".into(),
                ))
            }
        }
    }
}

/// Sends job `id`'s request and reads the answer, at most `max_body` bytes of it; with
/// `tracing`, the run (from `queued` ago, when it began to wait) and its upstream call are
/// spans under the submission's.
pub(super) async fn send(
    running: &Running,
    tracing: Option<&Tracing>,
    route: &Route,
    id: &str,
    req: &JobRequest,
    max_body: u64,
    queued: std::time::Duration,
) -> Sent {
    let mut trace = tracing.map(|t| t.job_run(&route.label, id, &req.header, queued));
    let sent = exchange(running, route, req, max_body, tracing.zip(trace.as_mut())).await;
    if let Some(trace) = trace {
        let (status, upstream_status, error) = sent.outcome();
        trace.finish(status, upstream_status, error);
    }
    sent
}

impl Sent {
    /// The job's result status, the upstream's status, and why it failed (for its span).
    fn outcome(&self) -> (u16, Option<u16>, Option<&'static str>) {
        match self {
            Sent::Answer { stored, .. } => (stored.status, Some(stored.status), None),
            Sent::Unreachable(_) => (502, None, Some("unreachable")),
            Sent::TimedOut(_) => (504, None, Some("timeout")),
            Sent::TooLarge { .. } => (502, None, Some("response_too_large")),
            Sent::Broken { .. } => (502, None, Some("broken_response")),
        }
    }
}

async fn exchange(
    running: &Running,
    route: &Route,
    req: &JobRequest,
    max_body: u64,
    trace: Option<(&Tracing, &mut JobTrace)>,
) -> Sent {
    let Opened {
        session: mut s,
        within,
        sent_at,
        read_timeout,
        abandon,
    } = match open(running, route, req, trace).await {
        Ok(o) => o,
        Err(m) => return Sent::Unreachable(m),
    };
    match tokio::time::timeout(read_timeout, read_head(&mut s)).await {
        Err(_) => {
            return Sent::TimedOut(Box::new(Follow {
                session: s,
                deadline: sent_at + abandon.max(read_timeout),
            }))
        }
        Ok(Err(e))
            if upstreams::had_request(&e, Some(sent_at.elapsed()), within)
                || upstreams::read_before_closing(&e, tcp_info(&s)) =>
        {
            return Sent::Broken {
                upstream: sent_at.elapsed(),
                detail: e.to_string(),
            }
        }
        Ok(Err(e)) => return Sent::Unreachable(e.into()),
        Ok(Ok(())) => {}
    }
    let upstream = sent_at.elapsed();
    let Some(head) = s.response_header().cloned() else {
        return Sent::Unreachable(Unreachable::NoHead);
    };
    let body = match read_body(&mut s, max_body, read_timeout).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => return Sent::TooLarge { upstream },
        Err(BodyError::Broken(detail)) => return Sent::Broken { upstream, detail },
    };
    let stated = route.fidelity.cost_from_response.as_ref();
    let report = stated.map(|name| Report::read(&head.headers, name, route.cost));
    let headers = head
        .headers
        .iter()
        .filter(|(n, _)| kept(n) && stated != Some(*n))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    Sent::Answer {
        stored: Stored {
            status: head.status.as_u16(),
            headers,
            body,
        },
        upstream,
        report,
    }
}
