//! The admission of one request (`request_filter`'s work): identify, classify, decide in the
//! store, queue or hold, and arm what follows the upstream.

use std::time::Duration;

use super::*;

use crate::admission::Ticket;
use crate::route::Route;
use crate::state::Running;
use crate::store::{Admission, AdmitRequest};

impl Gateway {
    /// Classifies, identifies and admits; `Err` is the refusal to send, `Ok(false)` a client
    /// that left before its request could be forwarded.
    pub(super) async fn decide(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> Result<bool, Refusal> {
        let running = match &ctx.running {
            Some(r) => r.clone(),
            None => {
                let r = self.shared.running();
                ctx.running = Some(r.clone());
                r
            }
        };
        let Some((route, admit)) = self.classify_and_identify(session, ctx, &running)? else {
            // An async job: `jobs::submit` takes it from here.
            return Ok(true);
        };

        // Admit: budget, per-key cap and route cap in one store decision. A client that
        // leaves while queued for a slot is never admitted (the store's admit is cancel-safe).
        // An HTTP/2 client leaves by resetting its stream.
        // A capped route's request may also be held for its `max_delay` turn before it joins
        // the queue (`crate::hold`): a client that leaves meanwhile is never admitted either.
        let may_queue = route.max_in_flight.is_some();
        let t = Instant::now();
        ctx.timing.asked = Some(t);
        // What the store held it for its turn, told apart from its queue time.
        let clock = may_queue.then(|| match route.fidelity.shadow {
            true => crate::hold::HoldClock::never(),
            false => crate::hold::HoldClock::default(),
        });
        // Counted for the exit, which waits for every waiting request to be answered.
        let waiting = may_queue.then(|| self.shared.drain.waiting());
        let answer = match &clock {
            Some(clock) => {
                // A decision dropped before it answered: it was held, then waited in the queue
                // (how much of that was the store's own work, the dropped call cannot say),
                // under `on_error` if the store is away (nor which way it went).
                let dropped = |ctx: &mut Ctx| {
                    ctx.timing.hold = clock.held();
                    ctx.timing.queued = t.elapsed().saturating_sub(ctx.timing.hold);
                    ctx.fallback = self.shared.store.degraded();
                };
                tokio::select! {
                    a = clock.scope(self.shared.store.decide(&admit)) => a,
                    _ = self.shared.drain.grace_over() => {
                        // Still waiting for a slot as the instance exits: it leaves the queue
                        // and its charge goes back (the dropped decision's, as for a client
                        // that leaves), and it is answered, not cut off; the connection closes.
                        dropped(ctx);
                        ctx.leaving = waiting;
                        session.set_keepalive(None);
                        return Err(decision::exiting_while_queued(&route, ctx.timing.queued));
                    }
                    _ = front::client_left(&mut session.downstream_session) => {
                        dropped(ctx);
                        running.metrics.get(&route).queue_wait.observe(ctx.timing.queued.as_secs_f64());
                        ctx.phase = Phase::Abandoned;
                        return Ok(false);
                    }
                }
            }
            None => self.shared.store.decide(&admit).await,
        };
        let store_held = clock.map_or(Duration::ZERO, |c| c.held());
        let elapsed = t.elapsed().saturating_sub(store_held);
        ctx.fallback = answer.fallback;
        ctx.share = answer.share;
        let answer = answer.admission;
        // An instance that exits before a held request's turn answers it (and closes the
        // connection), whatever the route's shadow mode: it is not forwarded on the way out.
        let exiting = matches!(answer, Admission::NotHeld { exiting: true, .. });
        let admitted = match decision::judge(&route, answer) {
            Ok(a) => a,
            Err(r) => {
                ctx.timing.store = elapsed.saturating_sub(r.queued);
                ctx.timing.hold = store_held;
                if exiting {
                    ctx.leaving = waiting;
                    session.set_keepalive(None);
                    return Err(r);
                }
                return shadow_or_refuse(ctx, &route, running.metrics.get(&route), r);
            }
        };
        ctx.timing.store = elapsed.saturating_sub(admitted.queued);
        let m = running.metrics.get(&route);
        if route.max_in_flight.is_some() {
            m.queue_wait.observe(admitted.queued.as_secs_f64());
        }
        let (hold, queued) = (admitted.hold, admitted.queued);
        let mut ticket = Ticket::new(admit, admitted.outcome, admitted.lease);
        // Held requests are bounded per instance: past the bound, give the reservation back
        // and refuse (429 with Retry-After) rather than queue without limit.
        let held = if hold.is_zero() {
            None
        } else {
            match self.shared.holds.try_permit() {
                Some(permit) => Some(permit),
                None => {
                    let outcome = ticket.refund(&self.shared.store).await;
                    let r = decision::too_many_held(&route, hold, outcome);
                    return shadow_or_refuse(ctx, &route, m, r);
                }
            }
        };
        ctx.timing.hold = hold + store_held;
        ctx.admit(ticket.in_flight(&m.in_flight), queued);
        // Counted when admitted, not when it ends: a report running for minutes is in the
        // last minute's figures while it runs. The moment is its start plus its wait for a
        // slot (and a store's hold before it; the store's answer is not worth a clock read).
        m.count_recent(true, ctx.start + store_held + ctx.timing.queued);
        let armed = self.hold_then_arm(session, ctx, &route, hold).await;
        if armed.is_err() {
            // Given back as the instance exits: its permit goes back once it has been
            // answered (the exit waits for that: `app::give_back_held`).
            ctx.given_back = held;
        }
        armed
    }

    /// Classifies (the route is chosen from, and the upstream receives, the canonical target)
    /// and identifies (the raw key never leaves `decision::identify`): the route and what to
    /// ask the store, or `None` for a request that becomes an async job.
    // The refusal is returned by value once per refused request, as `decision`'s are.
    #[allow(clippy::result_large_err)]
    fn classify_and_identify(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        running: &Running,
    ) -> Result<Option<(Arc<Route>, AdmitRequest)>, Refusal> {
        let cfg = &running.config;
        let req = session.req_header();
        let target = String::from_utf8_lossy(req.raw_path());
        let classified = decision::classify(cfg, req.method.as_str(), &target);
        let classified = match classified {
            Ok(c) => c,
            Err(r) => {
                ctx.route = Some(cfg.router.default_route().clone());
                return Err(r);
            }
        };
        if let Some(m) = classified.forward_method.and_then(|m| m.parse().ok()) {
            // `head` is answered as the HEAD it is forwarded as: Pingora frames the answer
            // by the downstream's method (else it waits for the body of a GET's answer).
            session.req_header_mut().set_method(m);
        }
        let req = session.req_header();
        let route = classified.route.clone();
        ctx.route = Some(route.clone());
        ctx.forward = Some(classified);
        decision::require_host(req.version == http::Version::HTTP_11, &req.headers)?;
        decision::limit_connection_options(&req.headers)?;
        let who = decision::identify(cfg, &req.headers, ctx.origin.map(|o| o.client))?;
        let admit = decision::admit_request(&route, &who);
        ctx.identity = Some(who);
        // An async route's request that asks (or must) become a job: charged and queued by
        // `jobs::submit` instead (a shadow route only observes: its requests stay synchronous).
        let job = route.jobs.filter(|_| !route.fidelity.shadow);
        if job.is_some_and(|j| j.always || crate::jobs::prefers_async(&req.headers)) {
            ctx.job = Some(admit);
            return Ok(None);
        }
        Ok(Some((route, admit)))
    }

    /// An admitted request: held for `max_delay` (a client that leaves meanwhile gets its
    /// reservation back and is never forwarded: `false`; an instance that exits before its
    /// turn gives it back and refuses it), then, on a capped route, its slot armed to follow
    /// the upstream's work.
    async fn hold_then_arm(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Route,
        hold: Duration,
    ) -> Result<bool, Refusal> {
        if !hold.is_zero() {
            // max_delay: the units are reserved; hold the request until they are due. A client
            // that leaves meanwhile gets its reservation back and is never forwarded.
            let held = Instant::now();
            let drain = self.shared.drain.clone();
            tokio::select! {
                _ = tokio::time::sleep(hold) => {}
                _ = front::client_left(&mut session.downstream_session) => {
                    ctx.timing.hold = held.elapsed();
                    // Boxed: the refund's future would make every request's larger.
                    Box::pin(ctx.abandon(&self.shared.store)).await;
                    return Ok(false);
                }
                _ = drain.exits_before(held + hold) => {
                    ctx.timing.hold = held.elapsed();
                    // The instance is going: answered, the connection closes (no unread body
                    // to discard first).
                    session.set_keepalive(None);
                    return Err(Box::pin(self.give_back_held(ctx, route)).await);
                }
            }
        }
        if route.max_in_flight.is_some() {
            // The slot follows the upstream's work: once the request is with the upstream, a
            // client that leaves no longer cancels it (see `front::ConnState::set_shield`).
            if session.is_body_empty() || session.is_body_done() {
                if let Some(c) = &ctx.conn {
                    c.set_shield(true);
                }
            } else {
                ctx.shield_after_body = true;
            }
        }
        Ok(true)
    }

    /// A held request whose turn this exiting instance will not reach: its reservation (and
    /// its key's charge) given back, and the refusal to answer it with (503 `route-busy`: it
    /// may go to another instance at once).
    async fn give_back_held(&self, ctx: &mut Ctx, route: &Route) -> Refusal {
        let standing = match std::mem::replace(&mut ctx.phase, Phase::Abandoned) {
            Phase::Admitted(mut ticket) => Some(ticket.refund(&self.shared.store).await),
            _ => None,
        };
        Refusal {
            queued: ctx.timing.queued,
            ..decision::exiting_before_turn(route, standing)
        }
    }
}
