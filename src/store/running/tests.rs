use std::time::Duration;

use super::*;
use crate::budget::Limit;

fn req(route: &Arc<str>, key: u8) -> AdmitRequest {
    AdmitRequest {
        key: [key; 32],
        limit: Limit::new(120, Duration::from_secs(3600), Duration::ZERO).unwrap(),
        also: vec![],
        cost: 1,
        key_cap: None,
        route: route.clone(),
        route_cap: Some(1),
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

/// A route's waiters with a local share of `share` and, per key, `per_key`.
struct Route {
    running: Arc<Running>,
    name: Arc<str>,
    limits: Limits,
}

impl Route {
    fn new(share: u32, per_key: Option<u32>) -> Route {
        Route {
            running: Arc::new(Running::default()),
            name: "/r".into(),
            limits: Limits {
                share,
                per_key,
                since: 0,
            },
        }
    }

    fn req(&self, key: u8) -> AdmitRequest {
        req(&self.name, key)
    }

    /// `r` joins the waiters with its plan's `weight`.
    fn queue(&self, r: &AdmitRequest, weight: u32) -> Place {
        let fair = Fair {
            weight,
            ..Fair::default()
        };
        self.running
            .queue(&self.name, short_key(&r.key), fair, self.limits)
    }

    fn take(&self, r: &AdmitRequest, p: &Place) -> Result<RunningGuard, Full> {
        self.running.try_take(r, Some(p), None)
    }

    /// The share becomes `share` as a reload loaded at `since` has it.
    fn reload(&self, share: u32, since: u64) {
        let l = Limits {
            share,
            since,
            ..self.limits
        };
        self.running.reconfigure([(self.name.clone(), l)]);
    }
}

const FULL: Option<Full> = Some(Full::Route);

#[test]
fn the_key_running_fewest_goes_first_then_the_oldest() {
    let r = Route::new(2, None);
    let (a, b) = (r.req(1), r.req(2));
    // a runs one already; two of a's wait, then one of b's.
    let held = r.running.track(slots_of(&a));
    let a1 = r.queue(&a, 1);
    let a2 = r.queue(&a, 1);
    let b1 = r.queue(&b, 1);
    assert_eq!(r.running.waiting("/r"), 3);
    // Room for one more (share 2): b's turn, though it came last.
    assert_eq!(r.take(&a, &a1).err(), FULL);
    let gb = r.take(&b, &b1).unwrap();
    drop(b1);
    // Full at 2.
    assert_eq!(r.take(&a, &a1).err(), FULL);
    drop(held);
    // a's own requests in arrival order.
    assert_eq!(r.take(&a, &a2).err(), FULL);
    let ga = r.take(&a, &a1).unwrap();
    drop((a1, ga, gb));
    assert!(r.take(&a, &a2).is_ok());
}

#[test]
fn with_one_slot_equals_take_turns() {
    let r = Route::new(1, None);
    let (a, b, c) = (r.req(1), r.req(2), r.req(3));
    // a holds the only slot; two of a's wait, then two of b's, then one of c's.
    let held = r.running.track(slots_of(&a));
    let a1 = r.queue(&a, 1);
    let _a2 = r.queue(&a, 1);
    let b1 = r.queue(&b, 1);
    let _b2 = r.queue(&b, 1);
    let c1 = r.queue(&c, 1);
    drop(held);
    // a freed it: b's turn (waiting since before c).
    assert_eq!(r.take(&a, &a1).err(), FULL);
    assert_eq!(r.take(&c, &c1).err(), FULL);
    let gb = r.take(&b, &b1).unwrap();
    drop((b1, gb));
    // b freed it: c's turn (waiting since before a last freed a slot), not a's head.
    assert_eq!(r.take(&a, &a1).err(), FULL);
    let gc = r.take(&c, &c1).unwrap();
    drop((c1, gc));
    assert!(r.take(&a, &a1).is_ok());
}

#[test]
fn weights_decide_whose_turn_it_is() {
    let r = Route::new(3, None);
    let (a, b) = (r.req(1), r.req(2));
    // a (weight 2) runs 1, b (weight 1) runs 1: a's 1/2 beats b's 1/1.
    let _ra = r.running.track(slots_of(&a));
    let _rb = r.running.track(slots_of(&b));
    let b1 = r.queue(&b, 1);
    let a1 = r.queue(&a, 2);
    assert_eq!(r.take(&b, &b1).err(), FULL);
    let _ga = r.take(&a, &a1).unwrap();
    drop(a1);
    // The key's own cap refuses.
    let _one = r.running.try_take(&b, None, Some(1)).unwrap();
    assert_eq!(r.running.try_take(&b, None, Some(1)).err(), Some(Full::Key));
}

#[test]
fn a_key_at_its_share_waits_and_lets_the_others_by() {
    let r = Route::new(9, Some(2));
    let (a, b) = (r.req(1), r.req(2));
    let _ra = (r.running.track(slots_of(&a)), r.running.track(slots_of(&a)));
    let a1 = r.queue(&a, 5);
    let b1 = r.queue(&b, 1);
    assert_eq!(r.take(&a, &a1).err(), FULL);
    assert!(r.take(&b, &b1).is_ok());
}

#[test]
fn free_slots_go_to_as_many_waiters_in_turn() {
    // Three keys join at once before any takes its turn (a request that cannot wait,
    // `queue_timeout: 0`, checks once): with two slots free the first two in turn take
    // one each, whichever of them checks first; the third waits.
    let r = Route::new(2, None);
    let (a, b, c) = (r.req(1), r.req(2), r.req(3));
    let pa = r.queue(&a, 1);
    let pb = r.queue(&b, 1);
    let pc = r.queue(&c, 1);
    assert_eq!(r.take(&c, &pc).err(), FULL);
    let gb = r.take(&b, &pb).unwrap();
    drop(pb);
    assert_eq!(r.take(&c, &pc).err(), FULL);
    let ga = r.take(&a, &pa).unwrap();
    drop(pa);
    assert_eq!(r.take(&c, &pc).err(), FULL);
    drop(gb);
    let gc = r.take(&c, &pc).unwrap();
    drop((pc, ga, gc));
}

#[test]
fn free_slots_pass_over_a_key_at_its_share() {
    // c runs 1 of 4: three free. In turn: a1, b1 (none running, a1 first); then a and b
    // are each at their share of 1: a2 and b2 wait, the third slot stays free.
    let r = Route::new(4, Some(1));
    let (a, b, c) = (r.req(1), r.req(2), r.req(3));
    let rc = r.running.track(slots_of(&c));
    let a1 = r.queue(&a, 1);
    let a2 = r.queue(&a, 1);
    let b1 = r.queue(&b, 1);
    let b2 = r.queue(&b, 1);
    assert_eq!(r.take(&a, &a2).err(), FULL);
    assert_eq!(r.take(&b, &b2).err(), FULL);
    let gb1 = r.take(&b, &b1).unwrap();
    drop(b1);
    let ga1 = r.take(&a, &a1).unwrap();
    drop(a1);
    assert_eq!(r.take(&a, &a2).err(), FULL);
    assert_eq!(r.take(&b, &b2).err(), FULL);
    // b below its share again: b2 in turn.
    drop(gb1);
    assert_eq!(r.take(&a, &a2).err(), FULL);
    assert!(r.take(&b, &b2).is_ok());
    drop((ga1, rc));
}

#[test]
fn a_waiter_served_is_no_longer_one() {
    // a (weight 2) takes one of two free slots; b, next, is not passed over for a's place,
    // which its request drops a moment later.
    let r = Route::new(3, None);
    let (a, b) = (r.req(1), r.req(2));
    let held = r.running.track(slots_of(&b));
    let pa = r.queue(&a, 2);
    let pb = r.queue(&b, 1);
    let ga = r.take(&a, &pa).unwrap();
    assert!(r.take(&b, &pb).is_ok());
    drop((pa, ga, held));
}

#[test]
fn a_reloads_share_holds_for_the_waiters_at_once() {
    let r = Route::new(2, None);
    let (a, b) = (r.req(1), r.req(2));
    let ran = (r.running.track(slots_of(&a)), r.running.track(slots_of(&a)));
    let (a1, b1) = (r.queue(&a, 1), r.queue(&b, 1));
    assert_eq!(r.take(&b, &b1).err(), FULL);
    // A larger share: both waiters take the new slots.
    r.reload(4, 10);
    let gb = r.take(&b, &b1).unwrap();
    let ga = r.take(&a, &a1).unwrap();
    drop((a1, b1));
    // An older config's share (a request decided before the reload) does not undo it.
    let b2 = r.running.queue(
        &r.name,
        short_key(&b.key),
        Fair::default(),
        Limits {
            share: 2,
            per_key: None,
            since: 5,
        },
    );
    drop((gb, ga));
    assert!(r.take(&b, &b2).is_ok());
    drop(b2);
    // A smaller one: nobody more while 2 run with a share of 1.
    r.reload(1, 20);
    let a3 = r.queue(&a, 1);
    assert_eq!(r.take(&a, &a3).err(), FULL);
    drop(ran);
    assert!(r.take(&a, &a3).is_ok());
}
