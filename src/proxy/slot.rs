//! What a request's slot follows: the upstream's work, not the client's connection (DESIGN §3).
//! When the gateway stops waiting for an answer the slot follows the upstream socket to the
//! late answer; when the upstream's whole answer is in before an HTTP/2 body has ended, the
//! slot goes at once.

use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::ctx::Ctx;

/// A request admitted to a capped route: its slot follows the upstream's work, through a
/// duplicate of the upstream socket, when the gateway stops waiting for the answer (the
/// client got its 504 at `read_timeout`; an HTTP/2 client reset its stream).
pub(super) fn follows_upstream(ctx: &Ctx) -> bool {
    ctx.is_admitted()
        && ctx
            .route
            .as_ref()
            .is_some_and(|r| r.max_in_flight.is_some())
}

/// An admitted HTTP/2 request whose charge is settled on the answer (`cost_per_second`,
/// `cost_from_response`): a stream reset before the answer's head is followed to the late
/// answer for its charge, on a route without a cap too (HTTP/1 has the client shield instead).
pub(super) fn settles_on_reset(session: &Session, ctx: &Ctx) -> bool {
    session.downstream_session.is_http2()
        // (A TLS upstream's late answer, read from the socket, is ciphertext.)
        && !ctx.upstream.tls
        && ctx.is_admitted()
        && ctx.route.as_ref().is_some_and(|r| {
            r.fidelity.cost_per_second.is_some() || r.fidelity.cost_from_response.is_some()
        })
}

/// Late answers followed at once for routes without a cap ([`settles_on_reset`]), a permit
/// each: each holds an upstream socket for up to `abandon_timeout`, and nothing else bounds
/// how many.
pub(super) static UNCAPPED_FOLLOWS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(256);

/// An HTTP/2 request admitted to a capped route: a reset stream is followed to the end of its
/// upstream connection (HTTP/1 has the client shield instead, see `front`).
pub(super) fn drains_on_reset(session: &Session, ctx: &Ctx) -> bool {
    session.downstream_session.is_http2() && follows_upstream(ctx)
}

/// The upstream's whole answer is in, and an HTTP/2 stream's body is not (an upstream that
/// answered without reading it): the upstream's work is done, so its slot goes now. The
/// stream lasts until its client ends it, and nothing times an HTTP/2 body out once the answer
/// is sent (Pingora has no read timeout for one): holding the slot until then let a client
/// keep a cap full for as long as it kept a connection.
pub(super) fn answered_before_the_body_ended(session: &Session, ctx: &mut Ctx) {
    if ctx.upstream.whole_request || !session.downstream_session.is_http2() {
        return;
    }
    if let Some(slot) = ctx.detach_slot() {
        tokio::spawn(slot.release());
    }
}

/// An answer whose head is all of it (RFC 9110 §6.4.1): to a HEAD, a 204 or 304, or one that
/// says `Content-Length: 0`.
pub(super) fn answer_has_no_body(session: &Session, resp: &ResponseHeader) -> bool {
    session.req_header().method == http::Method::HEAD
        || matches!(resp.status.as_u16(), 204 | 304)
        || resp
            .headers
            .get(http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0")
}
