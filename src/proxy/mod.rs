//! The Pingora edge: translates each proxy phase into calls on plain modules and back.
//!
//! `request_filter` asks [`crate::decision`] to classify, identify and judge the store's
//! answer, and writes the refusals; `upstream_peer` / `upstream_request_filter` forward what
//! was charged ([`forward`]); `response_filter` adds the rate-limit headers ([`respond`]);
//! `fail_to_proxy` refunds and answers 502/504; `logging` — which Pingora runs for every
//! request, whatever happened — releases slots, records metrics and writes the access log.
//! The request's state lives in [`ctx::Ctx`].

pub mod ctx;
mod decide;
mod failure;
pub mod forward;
mod jobs;
pub(crate) use jobs::job_in;
mod late;
mod record;
pub mod respond;
mod scrub;
mod slot;
mod submit;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};

use crate::decision::{self, Refusal};
use crate::front;
use crate::problem::Problem;
use crate::route::stated::Report;
use crate::state::Shared;
use crate::upstreams;
use ctx::{Ctx, Phase};
pub use record::{malformed_head, malformed_head_answer};
pub(crate) use scrub::set_by_gateway;
use slot::{
    answer_has_no_body, answered_before_the_body_ended, drains_on_reset, follows_upstream,
    settles_on_reset, UNCAPPED_FOLLOWS,
};

const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

pub struct Gateway {
    pub shared: Arc<Shared>,
}

/// The client went away (an HTTP/2 stream reset, or a closed connection) — not a failure.
fn client_went_away(e: &Error) -> bool {
    *e.esource() == ErrorSource::Downstream
        && matches!(
            e.etype(),
            ErrorType::H2Error
                | ErrorType::ConnectionClosed
                | ErrorType::ReadError
                | ErrorType::WriteError
        )
}

/// A refusal of the limiter on a `mode: shadow` route is counted and described, then the
/// request goes on as if it had passed (`Ok(true)`); any other is sent (`Err`).
// Returned by value once per refused request, like decision's refusals.
#[allow(clippy::result_large_err)]
fn shadow_or_refuse(
    ctx: &mut Ctx,
    route: &crate::route::Route,
    m: &crate::telemetry::RouteMetrics,
    r: Refusal,
) -> Result<bool, Refusal> {
    match decision::shadowed(route, &r) {
        Some(reason) => {
            m.shadow_rejection(reason);
            m.count_recent(true, ctx.start + r.queued);
            ctx.shadow(&r, reason);
            Ok(true)
        }
        None => Err(r),
    }
}

impl Gateway {
    /// The gateway stopped waiting for the upstream's answer while the upstream may still be
    /// working on it: the request's slot stays taken until that answer ends, read (and
    /// discarded) through the duplicate of the upstream socket, for at most
    /// `abandon_timeout` after the request was sent. Without a duplicate (an uncapped route)
    /// the slot, if any, is freed in `logging` as usual.
    /// With `settle`, a charge that depends on the answer is settled on it (`late.rs`).
    fn follow_late_answer(&self, ctx: &mut Ctx, answer: front::LateAnswer, settle: bool) {
        let Some(dup) = ctx.upstream.dup.take() else {
            return;
        };
        // A route without a cap bounds nothing of its own: so many late answers at once are
        // followed, past that the charge stays the admission's (the socket closes now).
        let uncapped = if follows_upstream(ctx) {
            None
        } else {
            let Ok(permit) = UNCAPPED_FOLLOWS.try_acquire() else {
                return;
            };
            Some(permit)
        };
        let sent = ctx.timing.upstream_start.unwrap_or(ctx.start);
        let deadline = sent + ctx.upstream.abandon_after;
        let settle = settle
            .then(|| late::LateSettle::take(&self.shared, ctx, sent))
            .flatten();
        if let Some(slot) = ctx.detach_slot() {
            // A shutdown waits for the settling as for a request.
            let drain = self.shared.drain.enter();
            tokio::spawn(async move {
                let (_drain, _uncapped) = (drain, uncapped);
                let stated = settle.as_ref().and_then(|s| s.stated_name());
                let learned =
                    front::drain_upstream(dup, deadline.into(), answer, stated, slot.release())
                        .await;
                if let Some(s) = settle {
                    s.finish(learned).await;
                }
            });
        }
    }

    async fn refuse(&self, session: &mut Session, ctx: &mut Ctx, r: Refusal) -> Result<bool> {
        // One admitted and then given back (held as its instance exits): its wait for a slot
        // was observed when it was admitted.
        let admitted = matches!(ctx.phase, Phase::Abandoned);
        ctx.refuse(&r);
        // A client refused a tunnel may already be writing into it: none of that is a request.
        if decision::is_connect(session.req_header().method.as_str()) {
            session.set_keepalive(None);
        }
        if let (Some(run), Some(route)) = (&ctx.running, &ctx.route) {
            if r.problem == Problem::RouteBusy && !admitted && r.waited_for_a_slot {
                run.metrics
                    .get(route)
                    .queue_wait
                    .observe(r.queued.as_secs_f64());
            }
        }
        respond::problem(session, ctx, r.problem, &r.detail, r.retry_after).await
    }

    /// At `logging`: the client's connection no longer shields the slot (a connection whose
    /// client left is not kept alive); an HTTP/2 client that reset its stream after sending
    /// the whole request leaves its slot with the upstream's late answer.
    fn unshield(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        if let Some(c) = &ctx.conn {
            c.set_shield(false);
            if c.client_gone() {
                session.set_keepalive(None);
            }
        }
        if let Some(dup) = ctx.upstream.dup.take() {
            // The upstream works on, so the slot stays taken until it is done. (Else the
            // duplicate just closes.)
            if session.downstream_session.is_http2()
                && e.is_some_and(client_went_away)
                && ctx.upstream.whole_request
            {
                ctx.upstream.dup = Some(dup);
                if ctx.upstream.status.is_none() && !ctx.upstream.tls {
                    // Nothing of the answer was read: it is read whole from its first byte,
                    // and the request's charge is settled on it (its stated cost, its time)
                    // as if its client had stayed (DESIGN §3: the charge follows the upstream).
                    let head = session.req_header().method == http::Method::HEAD;
                    self.follow_late_answer(ctx, front::LateAnswer::Whole { head }, true);
                } else if follows_upstream(ctx) {
                    // Part of the answer was read (its head, settled on): its request went
                    // with `Connection: close`, so it ends with the connection. (Without a
                    // slot to follow, the charge was settled on the head: nothing to follow.)
                    self.follow_late_answer(ctx, front::LateAnswer::UntilClose, false);
                }
            }
        }
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    /// Boxed: Pingora keeps the context by value in its per-request future, which it moves
    /// into a `Box` for every request on a connection, and holds it at more than one await
    /// point. A 1.1 KB context there cost ~3.4 KB of copying per request (callgrind); a box
    /// costs one allocation.
    type CTX = Box<Ctx>;

    fn new_ctx(&self) -> Box<Ctx> {
        Box::new(Ctx::new(self.shared.drain.enter()))
    }

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<()> {
        let running = self.shared.running();
        let limits = running.config.client_limits;
        ctx.origin = session.client_addr().and_then(|a| a.as_inet()).map(|a| {
            running
                .config
                .trusted_proxies
                .origin(a.ip(), &session.req_header().headers)
        });
        ctx.running = Some(running);
        if let Some(c) = front::conn_of(session) {
            c.head_done();
            ctx.conn = Some(c);
        }
        // A `Connection` that names `Host` or an `X-Forwarded-*` the gateway sets would make
        // Pingora refuse to forward the request once it was admitted (400, an ERROR logged).
        scrub::connection_options(session.req_header_mut())?;
        session.set_read_timeout(Some(limits.body_timeout));
        // A client that half-closes (FIN) after its request still reads the answer (RFC 9112
        // §9.6): Pingora would take the FIN for a client gone and drop the request it may
        // already have been charged for. One that really left fails the first write instead.
        session.downstream_session.set_abort_on_close(false);
        // Through the front door, an HTTP/1 client's stalled write is timed by its stream
        // (`front::Tracked`), which costs nothing while writes complete. An HTTP/2 stream can
        // stall on flow control with no socket write pending: Pingora's per-write timer then.
        if ctx.conn.is_none() || session.downstream_session.is_http2() {
            session.set_write_timeout(Some(limits.send_timeout));
        }
        let client_id = session.req_header().headers.get(&X_REQUEST_ID);
        ctx.request_id = Some(
            client_id
                .and_then(scrub::client_request_id)
                .unwrap_or_else(new_request_id),
        );
        if let Some(t) = &self.shared.tracing {
            ctx.trace = Some(t.begin(&session.req_header().headers));
        }
        Ok(())
    }

    // Pingora boxes this future for every request, copying all of it: the paths that are not
    // an admission (a job's, a refusal's) are boxed apart, so that it is the size of `decide`'s
    // (~2 KB, where it was 8.7 KB).
    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        if let Some(id) = jobs::job_named(session) {
            return Box::pin(jobs::status(self, session, ctx, id)).await;
        }
        match self.decide(session, ctx).await {
            Ok(true) if ctx.job.is_some() => Box::pin(submit::submit(self, session, ctx)).await,
            Ok(true) => Ok(false),
            Ok(false) => Error::e_explain(
                ErrorType::ConnectionClosed,
                "client left before its request was forwarded",
            )
            .map_err(|e| e.into_down()),
            Err(r) => Box::pin(self.refuse(session, ctx, r)).await,
        }
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if end_of_stream {
            // An empty last chunk (an HTTP/2 body ended by an empty DATA frame) is no chunk:
            // Pingora would write it as a terminator and then its own, and the HTTP/1 upstream
            // would read a second request (`0`) on the connection.
            if body.as_ref().is_some_and(|b| b.is_empty()) {
                *body = None;
            }
            ctx.upstream.body_watch = None;
            ctx.upstream.whole_request = true;
        } else if let Some(w) = &ctx.upstream.body_watch {
            w.touch();
        }
        if end_of_stream && ctx.shield_after_body {
            ctx.shield_after_body = false;
            if let Some(c) = &ctx.conn {
                c.set_shield(true);
            }
        }
        Ok(())
    }

    fn suppress_error_log(&self, _session: &Session, ctx: &Self::CTX, e: &Error) -> bool {
        // A client that went away or was too slow is not a gateway error; the access log has it.
        matches!(ctx.phase, Phase::Abandoned)
            || (*e.esource() == ErrorSource::Downstream
                && matches!(
                    e.etype(),
                    ErrorType::ConnectionClosed
                        | ErrorType::ReadError
                        | ErrorType::WriteError
                        | ErrorType::ReadTimedout
                        | ErrorType::WriteTimedout
                        | ErrorType::H2Error
                ))
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        let Some(running) = ctx.running.as_ref() else {
            return Error::e_explain(ErrorType::InternalError, "no config for request");
        };
        if let Some(name) = ctx.route.as_ref().and_then(|r| r.provider.upstream.clone()) {
            // A named upstream: the pool's next healthy address (none: 502, refunded).
            let pool = running.pools.get(&name);
            let Some((addr, target)) = pool.and_then(|p| p.pick(&ctx.upstream.refused_by)) else {
                return Error::e_explain(
                    ErrorType::ConnectNoRoute,
                    "no healthy address in the named upstream",
                );
            };
            ctx.upstream.host = Some(target.host_header.clone());
            ctx.upstream.abandon_after = target.abandon_timeout;
            (ctx.upstream.read_timeout, ctx.upstream.tls) = (target.read_timeout, target.tls);
            return Ok(Box::new(crate::upstreams::peer(addr, target)));
        }
        let Some(addr) = running.upstream_addr else {
            return Error::e_explain(ErrorType::ConnectNoRoute, "upstream host did not resolve");
        };
        let up = &running.config.upstream;
        ctx.upstream.abandon_after = up.abandon_timeout;
        (ctx.upstream.read_timeout, ctx.upstream.tls) = (up.read_timeout, up.tls);
        Ok(Box::new(crate::upstreams::peer(
            addr,
            &running.config.upstream,
        )))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
        forward::request(upstream, ctx, &session.req_header().headers, tls)?;
        if let (Some(t), Some(trace)) = (&self.shared.tracing, &mut ctx.trace) {
            trace.upstream_request(t, upstream)?;
        }
        if drains_on_reset(session, ctx) {
            // The end of the upstream's answer is then the end of its connection, which is
            // what `front::drain_upstream` waits for.
            upstream.insert_header(http::header::CONNECTION, "close")?;
        }
        ctx.timing.upstream_start = Some(Instant::now());
        Ok(())
    }

    async fn connected_to_upstream(
        &self,
        session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        fd: std::os::unix::io::RawFd,
        digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        ctx.upstream.had_request = None;
        ctx.upstream.whole_request = session.is_body_empty() || session.is_body_done();
        if !reused {
            upstreams::note_round_trip(&peer._address, digest);
        }
        // SAFETY: Pingora owns `fd` and keeps it open for the duration of this call; only
        // duplicates are kept.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        // The connection's TCP state says, should the upstream close it unanswered, whether
        // it read the request (`error_while_proxy`): on a kept-alive connection too, where a
        // close soon after sending is otherwise taken for the keep-alive race. And an exit
        // past the grace period cuts the request off through it (`Drain::cut_off`).
        match borrowed.try_clone_to_owned() {
            Ok(fd) => ctx.drain.follow_socket(fd),
            Err(_) => ctx.drain.let_go_socket(),
        }
        if follows_upstream(ctx) || settles_on_reset(session, ctx) {
            ctx.upstream.dup = borrowed.try_clone_to_owned().ok();
        }
        let h2_body = session.downstream_session.is_http2() && !ctx.upstream.whole_request;
        if let (true, Some(running)) = (h2_body, &ctx.running) {
            let timeout = running.config.client_limits.body_timeout;
            // SAFETY: as above; the watch keeps a duplicate.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            ctx.upstream.body_watch = front::BodyWatch::start(fd, timeout).ok();
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if respond::is_interim(resp) {
            // A `100 Continue` or `103 Early Hints` is relayed as it is: the upstream is still
            // working (its time still runs) and its answer, cost and status are yet to come.
            respond::drop_stated_cost(resp, ctx);
            return Ok(());
        }
        ctx.timing.upstream_done();
        // The upstream answered: it no longer waits on the client's body, nor is there a
        // close without an answer to judge.
        ctx.upstream.body_watch = None;
        if !ctx.upstream.whole_request && answer_has_no_body(session, resp) {
            // Its whole answer is this head: no body's end will say so.
            answered_before_the_body_ended(session, ctx);
        }
        ctx.upstream.status = Some(resp.status.as_u16());
        respond::take_stated_cost(resp, ctx);
        if matches!(ctx.report, Some(Report::Applied(_))) {
            // Final whatever the upstream's time: in the store before the client has its
            // answer, so that the key's next request, from any connection or instance, sees it.
            ctx.settle(&self.shared.store).await;
        }
        respond::rate_limit_headers(resp, ctx)
    }

    fn response_body_filter(
        &self,
        session: &mut Session,
        _body: &mut Option<bytes::Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<Option<Duration>> {
        if end_of_stream {
            answered_before_the_body_ended(session, ctx);
        }
        Ok(None)
    }

    /// The upstream never had the request. An address of a named pool that refused the
    /// connection (or did not accept it in time, or failed its TLS handshake) is not tried again
    /// for this request: it goes to the pool's next address, whatever its method, since it
    /// reached none (a pool without `health_check` would otherwise send every n-th request to
    /// a dead address and answer it 502).
    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut Self::CTX,
        mut e: Box<Error>,
    ) -> Box<Error> {
        ctx.upstream.had_request = Some(false);
        let name = ctx
            .route
            .as_ref()
            .and_then(|r| r.provider.upstream.as_deref());
        if let (Some(running), Some(_)) = (&ctx.running, name) {
            e.set_retry(
                running
                    .pools
                    .refused(name, peer, &mut ctx.upstream.refused_by),
            );
        }
        e
    }

    /// Decides, once, whether the upstream had the request (`upstreams::had_request`), for
    /// the charge (`fail_to_proxy`) and for sending it again. Pingora sends an idempotent
    /// request again on a new connection when the reused one it went on failed, even after
    /// the upstream had it and worked on it: it would then run twice for one charge. It is
    /// sent again only when the upstream never had it (the connection closed under it at once).
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Self::CTX,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        // Cut off by the exiting instance: it had the request if it was sent before the cut
        // (one that connected after it was shut at once, unsent), and it is not sent again.
        let cut = self.shared.drain.cut_at();
        let had = match cut {
            Some(at) => ctx.timing.upstream_start.is_some_and(|sent| sent < at),
            None => failure::had_request(&e, peer, ctx),
        };
        ctx.upstream.had_request = Some(had);
        // Pingora has closed its descriptor: the duplicate must not hold the connection open
        // while the request is answered.
        ctx.drain.let_go_socket();
        if cut.is_some()
            || !session.req_header().method.is_idempotent()
            || session.as_ref().retry_buffer_truncated()
            || had
        {
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Self::CTX,
    ) -> FailToProxy {
        self.failed(session, e, ctx).await
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Self::CTX) {
        self.unshield(session, e, ctx);
        // Now, with the upstream's answer read to its end (or abandon_timeout passed).
        ctx.release().await;
        // After the slots are free: settling is one more store call, for such routes only.
        ctx.settle(&self.shared.store).await;
        // Nothing written, or the gateway's own answer not taken: the client left first (a
        // closed connection, a reset stream).
        let status = match session.response_written() {
            Some(r) if !e.is_some_and(respond::nobody_answered) => r.status.as_u16(),
            _ => CLIENT_CLOSED_REQUEST,
        };
        // Requests Pingora refused before `request_filter` count under `default`.
        let running = ctx.running.clone().unwrap_or_else(|| self.shared.running());
        let route = match &ctx.route {
            Some(r) => r.clone(),
            None => running.config.router.default_route().clone(),
        };
        let rm = running.metrics.get(&route);
        let elapsed = ctx.start.elapsed();
        let charged = ctx.final_charge();
        record::finished(rm, ctx, status, elapsed, charged);
        let method = session.req_header().method.as_str();
        let trace_id = record::trace(self.shared.tracing.as_ref(), ctx, method, &route, status, e);
        let line = record::Line {
            method,
            route: &route,
            status,
            elapsed,
            charged,
        };
        record::access_line(ctx, &line, trace_id.as_ref(), e);
        if let (true, Some(_), Some(conn)) = (ctx.upstream.keep_client, e, &ctx.conn) {
            front::keep_after_failure(session, conn).await;
        }
    }
}

/// The status a request answered to nobody is counted and logged with (nginx's "client closed
/// request"): never sent.
const CLIENT_CLOSED_REQUEST: u16 = 499;

/// 32 hex digits of a random 128-bit number, written into a buffer and copied once
/// (`hex::encode` collects them char by char, through three reallocations: ~1,500 instructions
/// more per request).
fn new_request_id() -> String {
    let id = rand::random::<u128>().to_be_bytes();
    let mut digits = [0u8; 32];
    match hex::encode_to_slice(id, &mut digits)
        .ok()
        .and_then(|()| std::str::from_utf8(&digits).ok())
    {
        Some(hex) => hex.to_owned(),
        // Not reached (32 digits for 16 bytes, all ASCII); the slow way rather than a bad id.
        None => hex::encode(id),
    }
}
