//! A proxy attempt that failed: whether the upstream had the request (it is then charged and
//! never sent again), and what each side's failure is answered with (`fail_to_proxy`).

use pingora::proxy::{FailToProxy, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};

use super::ctx::Ctx;
use super::{respond, Gateway};
use crate::decision::{self, UpstreamFailure};
use crate::front;
use crate::problem::Problem;
use crate::telemetry::{metrics, ClientTimeout};
use crate::upstreams;

/// Whether the upstream had the request when the attempt on `peer` failed with `e`: by the
/// time since it was sent (`upstreams::had_request`), or by the connection's TCP state
/// (`upstreams::read_before_closing`), on a new connection or a kept-alive one alike.
pub(super) fn had_request(e: &Error, peer: &HttpPeer, ctx: &Ctx) -> bool {
    let sent = ctx.timing.upstream_start.map(|t| t.elapsed());
    let within = upstreams::stale_within(&peer._address);
    upstreams::had_request(e, sent, within)
        || (sent.is_some() && upstreams::read_before_closing(e, ctx.drain.socket_tcp_info()))
}

impl Gateway {
    /// `fail_to_proxy`: the upstream's side, the client's, or Pingora's own refusal.
    pub(super) async fn failed(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Ctx,
    ) -> FailToProxy {
        use ErrorType::*;
        // A relayed `100 Continue` is not the answer: after it the client still gets one.
        let headers_sent = session
            .response_written()
            .is_some_and(|h| !respond::is_interim(h));
        if ctx.upstream.body_watch.take().is_some_and(|w| w.stalled()) {
            // An HTTP/2 body stalled: its watch shut the upstream connection down.
            return respond::body_stalled(session, ctx, headers_sent).await;
        }
        let how = match (e.esource(), e.etype()) {
            (_, HTTPStatus(code)) => {
                if !headers_sent {
                    let _ = session.respond_error(*code).await;
                }
                return FailToProxy {
                    error_code: *code,
                    can_reuse_downstream: false,
                };
            }
            (ErrorSource::Upstream, ReadTimedout | WriteTimedout) => UpstreamFailure::TimedOut,
            // An answer, but not HTTP: it had the request.
            (ErrorSource::Upstream, InvalidHTTPHeader) => UpstreamFailure::Malformed,
            (ErrorSource::Upstream, _)
            | (_, ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError) => {
                // Decided when the attempt failed (`error_while_proxy`, `fail_to_connect`);
                // undecided, no attempt reached a connection (no upstream address).
                if ctx.upstream.had_request.unwrap_or(false) {
                    if self.shared.drain.is_cut_off() {
                        UpstreamFailure::CutOff
                    } else {
                        UpstreamFailure::HungUp
                    }
                } else {
                    UpstreamFailure::Unreachable
                }
            }
            (ErrorSource::Downstream, ReadTimedout) => {
                return respond::body_stalled(session, ctx, headers_sent).await;
            }
            (ErrorSource::Downstream, _) => {
                return self.client_failed(session, e, ctx, headers_sent).await;
            }
            _ => {
                if !headers_sent {
                    let _ = session.respond_error(500).await;
                }
                return FailToProxy {
                    error_code: 500,
                    can_reuse_downstream: false,
                };
            }
        };
        self.upstream_failed(session, ctx, how, headers_sent).await
    }

    /// `fail_to_proxy` for the upstream's side: unreachable (refunded before answering, so
    /// that the client's next request already sees the units back) or timed out (charged;
    /// a capped slot follows the late answer); once headers were sent, nothing to answer.
    async fn upstream_failed(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        how: UpstreamFailure,
        headers_sent: bool,
    ) -> FailToProxy {
        let failure = decision::upstream_failed(how);
        if headers_sent {
            // The upstream answered and then failed mid-body: it did the work, keep the charge.
            return FailToProxy {
                error_code: failure.problem.status(),
                can_reuse_downstream: false,
            };
        }
        if how == UpstreamFailure::TimedOut {
            // The upstream has the request and may still be working on it: the charge stands,
            // and a capped slot follows the late answer to its end — if the upstream had the
            // whole request (one still waiting for the rest of a stalled body is not working).
            // So does a charge that depends on the answer (`cost_per_second`: the time the
            // upstream worked; `cost_from_response`: what the late answer states).
            // (A route without a cap bills to the timeout: the duplicate an HTTP/2 request on
            // it may have is for a reset stream, `settles_on_reset`.)
            if ctx.upstream.whole_request && super::slot::follows_upstream(ctx) {
                let head = session.req_header().method == http::Method::HEAD;
                self.follow_late_answer(ctx, front::LateAnswer::Whole { head }, true);
            }
        } else if how == UpstreamFailure::Unreachable {
            // The upstream never received the request: refund, before answering, so that the
            // client's next request already sees the units back.
            ctx.refund(&self.shared.store, failure.problem).await;
        }
        // HungUp (CutOff): the upstream had the request and is done with it (or the exiting
        // instance with the upstream): charged. Its slot is
        // freed now (a timed-out one's follows the late answer): reading past the rest of the
        // body below must not hold it.
        ctx.timing.upstream_done();
        ctx.release().await;
        // An HTTP/1 client's connection goes on, and what it pipelined behind this request is
        // answered (DESIGN §3: never dropped): the answer reads past what is left of the body,
        // as a refusal's does (`respond::send`), or says it closes. Pingora closes the
        // connection after an upstream error whatever this hook returns: `logging` takes it
        // back from the session, through the front door.
        let h1 = ctx.conn.is_some() && !session.downstream_session.is_http2();
        if !h1 {
            session.set_keepalive(None);
        }
        let sent = respond::problem(session, ctx, failure.problem, &failure.detail, None).await;
        // Only after an answer that went out whole, with the request read to its end: a client
        // whose socket failed under it is not read from again.
        ctx.upstream.keep_client = h1
            && sent.is_ok()
            && session.is_body_done()
            && session.downstream_session.get_keepalive().is_some();
        FailToProxy {
            error_code: failure.problem.status(),
            can_reuse_downstream: false,
        }
    }

    /// `fail_to_proxy` for the client's side: it went away, stalled or sent garbage.
    async fn client_failed(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Ctx,
        headers_sent: bool,
    ) -> FailToProxy {
        use ErrorType::*;
        if e.etype() == &WriteTimedout && !ctx.conn.as_ref().is_some_and(|c| c.send_timed_out()) {
            metrics().client_timeout(ClientTimeout::Send);
        }
        // Nobody to answer, unless the request itself was wrong.
        let code = match e.etype() {
            WriteError | ReadError | ConnectionClosed | WriteTimedout | H2Error => 0,
            _ => 400,
        };
        if code > 0 && !headers_sent {
            // A request the client framed wrongly (a chunk size that overflows, say) after its
            // admission: the upstream had it (its head, and its body up to there), and its slot
            // was held meanwhile, so it stays charged, as one whose client left mid-body or
            // stalled (DESIGN §3: holding a slot costs what the slot is worth; refunded, a key
            // could drip a body into every slot of a capped route and then break it, free).
            // The rest of the connection's bytes cannot be framed: answer, then close.
            session.set_keepalive(None);
            let detail = "the request could not be read: its framing is malformed";
            let _ = respond::problem(session, ctx, Problem::BadRequest, detail, None).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }
}
