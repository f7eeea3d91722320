use super::*;

fn fair(weight: u32) -> Fair {
    Fair {
        weight,
        ..Fair::default()
    }
}

/// Joins `key` and expects to wait.
fn wait(q: &RouteQueues, cap: u32, key: u128, f: Fair) -> Waiting {
    match q.join(&Arc::from("r"), cap, key, f) {
        Joined::Waiting(w) => w,
        other => panic!("expected to wait, got {other:?}"),
    }
}

fn slot(q: &RouteQueues, cap: u32, key: u128, f: Fair) -> RouteSlot {
    match q.join(&Arc::from("r"), cap, key, f) {
        Joined::Slot(s) => s,
        other => panic!("expected a slot, got {other:?}"),
    }
}

/// Whether `w` was granted (without waiting).
fn granted(w: &mut Waiting) -> bool {
    w.rx.as_mut().is_some_and(|rx| rx.try_recv().is_ok())
}

#[test]
fn a_freed_slot_goes_to_the_key_with_fewest_running_then_the_longest_waiting() {
    let q = RouteQueues::default();
    // Key 1 fills both slots and queues 5 more; then keys 2 and 3 queue one each.
    let s1 = slot(&q, 2, 1, fair(1));
    let s2 = slot(&q, 2, 1, fair(1));
    let mut a: Vec<Waiting> = (0..5).map(|_| wait(&q, 2, 1, fair(1))).collect();
    let mut b = wait(&q, 2, 2, fair(1));
    let mut c = wait(&q, 2, 3, fair(1));
    assert_eq!(q.counts("r"), (2, 7));
    // First release: key 2 (0 running, waited longer than key 3) goes before key 1's queue.
    drop(s1);
    assert!(granted(&mut b));
    assert!(!granted(&mut c) && !a.iter_mut().any(granted));
    // Second (key 1's own): keys 1 and 3 both run none now, and key 1's head waited longest,
    // but key 1 freed the slot: key 3 goes first (else key 1's backlog would keep it).
    drop(s2);
    assert!(granted(&mut c));
    assert!(!a.iter_mut().any(granted));
    // Third (key 2's): key 1 runs none, key 3 one: key 1's head.
    let b_slot = RouteSlot {
        queue: lock(&q.routes)["r"].clone(),
        key: 2,
    };
    drop(b_slot);
    assert!(granted(&mut a[0]));
    assert!(!a[1..].iter_mut().any(granted));
    assert_eq!(q.counts("r"), (2, 4));
}

#[test]
fn with_one_slot_the_key_that_freed_it_goes_after_its_equals() {
    let q = RouteQueues::default();
    // Key 1 holds the only slot with three more queued; key 2 queues one after them.
    let s = slot(&q, 1, 1, fair(1));
    let mut a: Vec<Waiting> = (0..3).map(|_| wait(&q, 1, 1, fair(1))).collect();
    let mut b = wait(&q, 1, 2, fair(1));
    // Both run nothing once key 1's request ends; key 2 goes, after one release.
    drop(s);
    assert!(granted(&mut b));
    assert!(!a.iter_mut().any(granted));
    // Key 2's release: key 1 is the only one waiting.
    drop(RouteSlot {
        queue: lock(&q.routes)["r"].clone(),
        key: 2,
    });
    assert!(granted(&mut a[0]));
    assert!(!a[1..].iter_mut().any(granted));
}

#[test]
fn a_keys_own_requests_run_in_arrival_order_and_weights_share_the_slots() {
    let q = RouteQueues::default();
    let cap = 3;
    let held: Vec<RouteSlot> = (0..cap).map(|_| slot(&q, cap, 9, fair(1))).collect();
    // Key 1 of weight 2 and key 2 of weight 1 each queue 6.
    let mut heavy: Vec<Waiting> = (0..6).map(|_| wait(&q, cap, 1, fair(2))).collect();
    let mut light: Vec<Waiting> = (0..6).map(|_| wait(&q, cap, 2, fair(1))).collect();
    drop(held);
    // Three free slots: heavy 0/2 = light 0/1, heavy waited longer; then light 0/1 < heavy
    // 1/2; then heavy 1/2 < light 1/1.
    let got_heavy: Vec<bool> = heavy.iter_mut().map(granted).collect();
    let got_light: Vec<bool> = light.iter_mut().map(granted).collect();
    assert_eq!(got_heavy, [true, true, false, false, false, false]);
    assert_eq!(got_light, [true, false, false, false, false, false]);
}

#[test]
fn a_per_key_share_makes_the_key_wait_while_others_run() {
    let q = RouteQueues::default();
    let f = Fair {
        per_key: Some(1),
        ..Fair::default()
    };
    let s = slot(&q, 3, 1, f);
    // Key 1 is at its share: it waits although two slots are free; key 2 does not.
    let mut w = wait(&q, 3, 1, f);
    let _other = slot(&q, 3, 2, f);
    assert!(!granted(&mut w));
    drop(s);
    assert!(granted(&mut w));
}

#[test]
fn max_queue_bounds_the_waiters_and_a_waiter_that_leaves_frees_its_place() {
    let q = RouteQueues::default();
    let f = Fair {
        max_queue: Some(2),
        ..Fair::default()
    };
    let s = slot(&q, 1, 1, f);
    let w1 = wait(&q, 1, 2, f);
    assert!(!q.full("r", 4, f), "one place left");
    let mut w2 = wait(&q, 1, 3, f);
    // What a job asks before its body is read: the join it would make now.
    assert!(q.full("r", 4, f));
    assert!(!q.full("other", 4, f));
    assert!(matches!(
        q.join(&Arc::from("r"), 1, 4, f),
        Joined::QueueFull
    ));
    drop(w1);
    assert!(!q.full("r", 4, f));
    assert_eq!(q.counts("r"), (1, 1));
    let _w3 = wait(&q, 1, 4, f);
    // The waiter that left is skipped: the slot goes to the next one.
    drop(s);
    assert!(granted(&mut w2));
}

#[test]
fn a_waiter_granted_as_it_gives_up_passes_the_slot_on() {
    let q = RouteQueues::default();
    let s = slot(&q, 1, 1, fair(1));
    let w1 = wait(&q, 1, 2, fair(1));
    let mut w2 = wait(&q, 1, 3, fair(1));
    drop(s); // granted to w1...
    drop(w1); // ...which had given up: w2 gets it.
    assert!(granted(&mut w2));
    assert_eq!(q.counts("r"), (1, 0));
}

#[tokio::test]
async fn granted_resolves_when_the_slot_is_handed_over() {
    let q = Arc::new(RouteQueues::default());
    let s = slot(&q, 1, 1, fair(1));
    let w = wait(&q, 1, 2, fair(1));
    let task = tokio::spawn(w.granted());
    drop(s);
    let s2 = tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(q.counts("r"), (1, 0));
    drop(s2);
    assert_eq!(q.counts("r"), (0, 0));
}

/// A place is the waiter's rank in the fair order (1: next), kept up to date: key 2's one
/// waiter, queued after key 1's first, is served first (key 1 runs one, key 2 none).
#[test]
fn a_place_is_the_rank_in_the_fair_order_until_it_leaves_the_queue() {
    let q = RouteQueues::default();
    let s = slot(&q, 1, 1, fair(1));
    let a = wait(&q, 1, 1, fair(1));
    let b = wait(&q, 1, 2, fair(1));
    let c = wait(&q, 1, 1, fair(1));
    let (pa, pb, pc) = (a.place(), b.place(), c.place());
    assert_eq!(
        (pa.position(), pb.position(), pc.position()),
        (Some(2), Some(1), Some(3))
    );
    drop(b);
    assert_eq!(
        (pa.position(), pb.position(), pc.position()),
        (Some(1), None, Some(2))
    );
    // The slot goes to `a`: it no longer waits.
    drop(s);
    assert_eq!((pa.position(), pc.position()), (None, Some(1)));
    drop((a, c));
    assert_eq!(pc.position(), None);
}

/// Positions say the order the queue serves in: with one slot, each holder ending in turn,
/// three keys' waiters (backlogs of 3, 2 and 1, interleaved) are granted exactly in the order
/// of the positions they had before the first release.
#[test]
fn positions_are_the_order_the_queue_serves_in() {
    let q = RouteQueues::default();
    let s = slot(&q, 1, 1, fair(1));
    let mut waiters: Vec<(u128, Waiting)> = [1, 1, 2, 1, 3, 2]
        .into_iter()
        .map(|key| (key, wait(&q, 1, key, fair(1))))
        .collect();
    let places: Vec<usize> = waiters
        .iter()
        .map(|(_, w)| w.place().position().unwrap())
        .collect();
    assert_eq!(places, [3, 5, 1, 6, 2, 4]);
    drop(s);
    let mut served = vec![];
    while served.len() < waiters.len() {
        let i = (0..waiters.len())
            .find(|&i| !served.contains(&places[i]) && granted(&mut waiters[i].1))
            .expect("a release grants the next waiter");
        served.push(places[i]);
        drop(RouteSlot {
            queue: lock(&q.routes)["r"].clone(),
            key: waiters[i].0,
        });
    }
    assert_eq!(served, [1, 2, 3, 4, 5, 6]);
}

/// A key at its per-key share is passed over while others may be served; its waiter comes
/// after them, as its own running request must end first.
#[test]
fn a_place_behind_the_keys_own_share_comes_after_the_others() {
    let q = RouteQueues::default();
    let shared = Fair {
        per_key: Some(1),
        ..Fair::default()
    };
    let _s = slot(&q, 2, 1, shared);
    let _t = slot(&q, 2, 2, shared);
    let a = wait(&q, 2, 1, shared);
    let b = wait(&q, 2, 3, shared);
    let c = wait(&q, 2, 3, shared);
    assert_eq!(
        (
            a.place().position(),
            b.place().position(),
            c.place().position()
        ),
        (Some(2), Some(1), Some(3))
    );
}

/// Equals take turns: with one slot, keys 1 and 2 each with a backlog and key 3 with one
/// request queued after them all, key 3 goes after one release of each (not after the
/// backlogs queued before it).
#[test]
fn with_one_slot_equals_take_turns() {
    let q = RouteQueues::default();
    let s = slot(&q, 1, 1, fair(1));
    let mut a: Vec<Waiting> = (0..3).map(|_| wait(&q, 1, 1, fair(1))).collect();
    let mut b: Vec<Waiting> = (0..3).map(|_| wait(&q, 1, 2, fair(1))).collect();
    let mut c = wait(&q, 1, 3, fair(1));
    let release = |key: u128| {
        drop(RouteSlot {
            queue: lock(&q.routes)["r"].clone(),
            key,
        })
    };
    // Key 1's release: key 2 (waiting since before key 3).
    drop(s);
    assert!(granted(&mut b[0]));
    // Key 2's release: key 3 (waiting since before key 1 last freed a slot), not key 1's head.
    release(2);
    assert!(granted(&mut c));
    assert!(!a.iter_mut().any(granted));
    // Key 3's: key 1, then key 2, in turn.
    release(3);
    assert!(granted(&mut a[0]));
    release(1);
    assert!(granted(&mut b[1]));
    assert!(!a[1..].iter_mut().any(granted));
}

/// A place is worked out only while that is cheap: past 200,000 steps × keys of the
/// simulation (here a thousand keys with one waiter each) the queue's length stands for it,
/// an upper bound; near the head it is still exact.
#[test]
fn a_place_far_down_a_long_queue_is_bounded_by_its_length() {
    let q = RouteQueues::default();
    let _s = slot(&q, 1, 0, fair(1));
    let waiting: Vec<Waiting> = (1..=1000).map(|key| wait(&q, 1, key, fair(1))).collect();
    assert_eq!(waiting[0].place().position(), Some(1));
    assert_eq!(waiting[10].place().position(), Some(11));
    // The 500th: 500 steps over 1,000 keys is past the bound: the queue's 1,000.
    assert_eq!(waiting[499].place().position(), Some(1000));
}

/// A reload's cap holds for the waiters at once, and a request decided under the config
/// before it (a job whose upload spanned the reload) does not undo it when it joins late:
/// only a config loaded no earlier than the one in force sets the cap.
#[test]
fn a_reloaded_cap_reaches_the_waiters_and_an_older_config_does_not_undo_it() {
    let q = RouteQueues::default();
    let old = Fair {
        since: 1,
        ..fair(1)
    };
    let s1 = slot(&q, 1, 1, old);
    let mut w2 = wait(&q, 1, 2, old);
    let mut w3 = wait(&q, 1, 3, old);
    // Raised to 3: both waiters run at once.
    q.reconfigure("r", 3, None, 2);
    assert!(granted(&mut w2) && granted(&mut w3));
    assert_eq!(q.counts("r"), (3, 0));
    // Lowered to 1 while 3 run: a late join under the old config (cap 1 too, but older)
    // changes nothing, one under a config older than the raise does not bring 3 back.
    q.reconfigure("r", 1, None, 3);
    let mut w4 = wait(
        &q,
        3,
        4,
        Fair {
            since: 2,
            ..fair(1)
        },
    );
    drop(s1);
    assert!(!granted(&mut w4), "3 → 2 running: still above the cap of 1");
    assert_eq!(q.counts("r"), (2, 1));
}

/// A waiter not to be served before its due time (a job held for its `max_delay` turn) never
/// takes a free slot ahead of it, and keeps none idle: another key takes the slot at once, and
/// a slot freed before the due time goes on to the next waiter that may run. At the due time
/// the queue grants it by itself, with no release to trigger it.
#[tokio::test]
async fn a_waiter_not_yet_due_keeps_no_slot_idle_and_is_served_when_due() {
    let q = RouteQueues::default();
    let route: Arc<str> = Arc::from("r");
    // An hour ahead: no scheduler delay reaches it during the checks.
    let later = Instant::now() + std::time::Duration::from_secs(3600);
    let held = match q.join_due(&route, 1, 1, fair(1), Some(later)) {
        Joined::Waiting(w) => w,
        other => panic!("expected to wait, got {other:?}"),
    };
    assert_eq!(q.counts("r"), (0, 1));
    // The free slot is another key's at once; freed, it goes to the next waiter that may run.
    let s2 = slot(&q, 1, 2, fair(1));
    let w3 = wait(&q, 1, 3, fair(1));
    drop(s2);
    assert_eq!(
        q.counts("r"),
        (1, 1),
        "key 3 waited behind a waiter not yet due"
    );
    let s3 = w3.granted().await;
    // Key 3's slot freed before the due time: nobody may take it.
    drop(s3);
    assert_eq!(q.counts("r"), (0, 1));
    drop(held);
    assert_eq!(q.counts("r"), (0, 0));

    // Due soon, alone in the queue beside a free slot: granted at its time by the queue
    // itself, with no release to trigger it, and never before (the queue reads the clock).
    let due = Instant::now() + std::time::Duration::from_millis(100);
    let held = match q.join_due(&route, 1, 1, fair(1), Some(due)) {
        Joined::Waiting(w) => w,
        other => panic!("expected to wait, got {other:?}"),
    };
    let slot = tokio::time::timeout(std::time::Duration::from_secs(10), held.granted())
        .await
        .expect("never granted once due");
    assert!(Instant::now() >= due);
    assert_eq!(q.counts("r"), (1, 0));
    drop(slot);
    assert_eq!(q.counts("r"), (0, 0));
}

/// `max_queue` bounds waiters not yet due too: such a waiter queues even beside a free slot
/// (it never takes one ahead of its time), so the bound is counted without the free slot.
#[tokio::test]
async fn a_waiter_not_yet_due_is_bounded_by_max_queue() {
    let q = RouteQueues::default();
    let route: Arc<str> = Arc::from("r");
    let f = Fair {
        max_queue: Some(1),
        ..fair(1)
    };
    let due = Some(Instant::now() + std::time::Duration::from_secs(60));
    let first = q.join_due(&route, 2, 1, f, due);
    assert!(matches!(first, Joined::Waiting(_)), "{first:?}");
    assert!(matches!(
        q.join_due(&route, 2, 2, f, due),
        Joined::QueueFull
    ));
    // A request that may run takes a free slot as before.
    assert!(matches!(q.join(&route, 2, 3, f), Joined::Slot(_)));
}
