//! `admit_batch` against the model: batches of interleaved keys and plans, decided by a real
//! `redis-server`, each reply compared with the memory store's GCRA (`crate::budget`) deciding
//! the same request at the very instant (Redis `TIME`) that call was decided at.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::super::admit_call;
use super::super::conn::Conn;
use super::super::script::{
    self, AdmitBatch, AdmitCall, AdmitCode, Lua, Op, Packed, Refund, Settle, Undo, Unspend,
};
use super::super::slices::{hold_field, Ask, IfLost};
use crate::budget::Limit;
use crate::store::memory::{Clock, MemoryStore};
use crate::store::{Admission, AdmitRequest, Bucket, Extra};

/// A `redis-server` on a Unix socket of its own (no port to race for), stopped on drop.
struct Redis {
    child: Child,
    dir: std::path::PathBuf,
}

impl Redis {
    fn start() -> Redis {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-batch-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no"])
            .arg("--unixsocket")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        for _ in 0..500 {
            if sock.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(sock.exists(), "redis-server did not start");
        Redis { child, dir }
    }

    /// A connection, once the server answers: its socket file exists from `bind`, before it
    /// listens and loads (once in a few runs a first connect was refused).
    async fn conn(&self) -> Conn {
        let url = format!("redis+unix://{}", self.dir.join("redis.sock").display());
        let client = redis::Client::open(url).unwrap();
        let mut last = None;
        for _ in 0..200 {
            match client.get_multiplexed_async_connection().await {
                Ok(mut c) => match redis::cmd("PING").query_async::<String>(&mut c).await {
                    Ok(_) => return Conn::Node(c),
                    Err(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("redis-server did not answer: {last:?}");
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn request(key: u8, limit: Limit, also: Vec<Extra>, cost: u64) -> AdmitRequest {
    AdmitRequest {
        key: [key; 32],
        limit,
        also,
        cost,
        key_cap: None,
        route: Arc::from("r"),
        route_cap: None,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

/// A reply as the figures both stores give: verdict, delay or retry (µs), remaining, reset.
fn redis_line(r: &[i64]) -> String {
    let code = AdmitCode::from_reply(r[0]).expect("a known code");
    format!("{code:?} a={} r={} reset={}", r[1], r[2], r[3])
}

fn model_line(a: &Admission) -> String {
    match a {
        Admission::Admitted {
            standing, delay_us, ..
        } => format!(
            "Admitted a={delay_us} r={} reset={}",
            standing.remaining, standing.reset_us
        ),
        Admission::OverBudget {
            standing,
            retry_after_us,
        } => format!(
            "OverBudget a={retry_after_us} r={} reset={}",
            standing.remaining, standing.reset_us
        ),
        other => format!("{other:?}"),
    }
}

/// 400 requests over four keys and three plans (one budget: `admit_one`; two budgets, the
/// second tighter or looser: `admit`), sent as batches of 1 to 9, straddling the ends of
/// small budgets again and again: every reply is what the model decides at its instant.
#[tokio::test]
async fn a_batch_decides_each_admission_as_the_model_does_alone() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let model = MemoryStore::new(Clock::manual(now));
    let hour = Duration::from_secs(3600);
    let minute = |max_cost, delay_s| Extra {
        bucket: Bucket::Key("minute".into()),
        limit: Limit::new(
            max_cost,
            Duration::from_secs(60),
            Duration::from_secs(delay_s),
        )
        .unwrap(),
    };
    let plans = [
        (Limit::new(12, hour, Duration::ZERO).unwrap(), vec![]),
        (
            Limit::new(30, hour, Duration::from_secs(600)).unwrap(),
            vec![minute(6, 20)],
        ),
        (
            Limit::new(9, hour, Duration::ZERO).unwrap(),
            vec![minute(40, 0)],
        ),
    ];
    let mut x: u64 = 0x2545f4914f6cdd1d;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut sent, mut admitted, mut refused, mut batches) = (0, 0, 0, 0);
    while sent < 400 {
        let size = 1 + (rand() % 9) as usize;
        let reqs: Vec<AdmitRequest> = (0..size)
            .map(|_| {
                let r = rand();
                let key = (r % 4) as u8;
                let (limit, also) = plans[((r >> 8) % 3) as usize].clone();
                request(
                    key * 3 + ((r >> 8) % 3) as u8,
                    limit,
                    also,
                    1 + (r >> 16) % 4,
                )
            })
            .collect();
        let calls: Vec<AdmitCall> = reqs
            .iter()
            .map(|req| admit_call(req, Ask::default(), format!("t:{sent}:{}", rand()), hour))
            .collect();
        let Packed(replies) = script::invoke(&AdmitBatch(&calls).invocation(), &mut conn)
            .await
            .unwrap();
        assert_eq!(replies.len(), size);
        for (i, (req, reply)) in reqs.iter().zip(&replies).enumerate() {
            now.store(reply[5] as u64, Ordering::Relaxed);
            let m = model.admit(req).await;
            assert_eq!(
                redis_line(reply),
                model_line(&m),
                "call {i} of a batch of {size} (request {})",
                sent + i
            );
            match m {
                Admission::Admitted { .. } => admitted += 1,
                _ => refused += 1,
            }
        }
        sent += size;
        batches += 1;
    }
    // The sequence reaches the budgets' ends on every plan, inside batches.
    assert!(
        admitted > 50 && refused > 100,
        "{admitted} admitted, {refused} refused"
    );
    assert!(batches < 120, "{batches} batches");
}

/// One admission sent twice in one batch (a resend) is charged once: the second finds its
/// record and answers from it.
#[tokio::test]
async fn an_admission_twice_in_a_batch_is_charged_once() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let req = request(7, limit, vec![], 4);
    let call = admit_call(
        &req,
        Ask::default(),
        "t:twice".into(),
        Duration::from_secs(60),
    );
    let other = admit_call(
        &req,
        Ask::default(),
        "t:other".into(),
        Duration::from_secs(60),
    );
    let calls = [call.clone(), call, other];
    let Packed(replies) = script::invoke(&AdmitBatch(&calls).invocation(), &mut conn)
        .await
        .unwrap();
    let codes: Vec<_> = replies
        .iter()
        .map(|r| AdmitCode::from_reply(r[0]).unwrap())
        .collect();
    assert_eq!(codes, [AdmitCode::Admitted; 3]);
    // Two charges of 4 of 10: 2 left (the resend's figures are the budget's as it stands).
    assert_eq!((replies[0][2], replies[1][2], replies[2][2]), (6, 6, 2));
}

/// A call that fails in its script answers `[-1]`, writing nothing, and the batch's other
/// calls are decided and charged as if it were not there.
#[tokio::test]
async fn a_failing_call_in_a_batch_leaves_the_others_standing() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let req = request(9, limit, vec![], 3);
    let good = admit_call(
        &req,
        Ask::default(),
        "t:good".into(),
        Duration::from_secs(60),
    );
    let mut bad = admit_call(
        &req,
        Ask::default(),
        "t:bad".into(),
        Duration::from_secs(60),
    );
    // The budget's key holds a hash: GET on it fails (WRONGTYPE) before anything is written.
    bad.budget = "t{broken}b".into();
    bad.record = "t{broken}a".into();
    let _: () = redis::cmd("HSET")
        .arg("t{broken}b")
        .arg("f")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let good2 = admit_call(
        &req,
        Ask::default(),
        "t:good2".into(),
        Duration::from_secs(60),
    );
    let calls = [good, bad, good2];
    let Packed(replies) = script::invoke(&AdmitBatch(&calls).invocation(), &mut conn)
        .await
        .unwrap();
    assert_eq!(replies[1], vec![-1]);
    let failed = super::one_of_batch(replies[1].clone()).unwrap_err();
    assert!(!failed.may_have_run(), "{failed}");
    assert_eq!(
        (replies[0][0], replies[0][2]),
        (AdmitCode::Admitted as i64, 7)
    );
    assert_eq!(
        (replies[2][0], replies[2][2]),
        (AdmitCode::Admitted as i64, 4)
    );
    let record: Option<String> = redis::cmd("GET")
        .arg("t{broken}a")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(record, None);
}

/// One `admit` call sent to `admit_one` (as the gateway sends a common one) or, `general`, to
/// `admit`: its code, remaining and held.
async fn send(c: &AdmitCall, general: bool, conn: &mut Conn) -> (AdmitCode, i64, i64) {
    let inv = if general {
        c.invocation_for(Lua::Admit)
    } else {
        c.invocation()
    };
    let r = script::invoke::<Packed>(&inv, conn)
        .await
        .unwrap()
        .one()
        .unwrap();
    (AdmitCode::from_reply(r[0]).unwrap(), r[2], r[7])
}

/// Field `field` of hash `key` set to `value`, as another instance or an old build left it.
async fn hset(conn: &mut Conn, key: &str, field: &str, value: &str) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg(field)
        .arg(value)
        .query_async(conn)
        .await
        .unwrap();
}

/// Hold `id` of `units` in the key's holds `holds`, expired long ago (at 1 µs).
async fn expired_hold(conn: &mut Conn, holds: &str, id: &str, units: u64) {
    hset(conn, holds, id, &format!("{units}:1")).await;
}

/// The `settle` of hold `id` of `call`'s key, `unspent` of it not spent.
async fn settle(conn: &mut Conn, call: &AdmitCall, id: &str, unspent: u64, if_lost: IfLost) {
    let budgets = call.budgets();
    let op = Settle {
        holds: &call.holds,
        budgets: &budgets,
        id,
        unspent,
        if_lost,
    };
    let r: i64 = script::invoke(&op.invocation(), conn).await.unwrap();
    assert_eq!(r, 1);
}

/// What Redis charges for a hold it lost with its data: 10 granted at `TIME` 5, 3 not spent.
const LOST: IfLost = IfLost {
    units: 10,
    granted_us: 5,
};

/// `admit_one` (the common decision, which looks for its record only once it has decided) and
/// `admit` on one sequence, each on a key of its own: an admission, its resend, a refusal,
/// a resend the budget would now refuse, an undone id sent again, and expired holds charged
/// by an admission and by a refusal. Same answers, same holds and records left behind.
#[tokio::test]
async fn admit_one_answers_and_writes_as_admit_does() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let mut seen = Vec::new();
    for (key, general) in [(30u8, false), (31u8, true)] {
        let req = |cost| request(key, limit, vec![], cost);
        let call = |cost, id: &str| {
            let c = admit_call(
                &req(cost),
                Ask::default(),
                id.into(),
                Duration::from_secs(60),
            );
            assert!(c.is_common());
            c
        };
        let (a, b) = (call(4, "t:a"), call(4, "t:b"));
        let holds = a.holds.clone();
        let mut lines = Vec::new();
        lines.push(send(&a, general, &mut conn).await); // admitted: 6 left
        lines.push(send(&a, general, &mut conn).await); // its resend: not charged again
        lines.push(send(&b, general, &mut conn).await); // admitted: 2 left
        lines.push(send(&call(4, "t:c"), general, &mut conn).await); // refused
        lines.push(send(&a, general, &mut conn).await); // a resend the budget would refuse
        let undone: i64 = script::invoke(&Undo(&b).invocation(), &mut conn)
            .await
            .unwrap();
        assert_eq!(undone, 1);
        lines.push(send(&b, general, &mut conn).await); // undone: nothing written
                                                        // An instance's hold that expired long ago (3 units, at 1 µs) is charged by the next
                                                        // admission...
        expired_hold(&mut conn, &holds, "x:s1", 3).await;
        lines.push(send(&call(1, "t:d"), general, &mut conn).await); // 4 + 3 + 1 of 10
                                                                     // ... and by a refusal.
        expired_hold(&mut conn, &holds, "x:s2", 5).await;
        lines.push(send(&call(1, "t:e"), general, &mut conn).await); // 8 + 5 + 1: refused
        lines.push(send(&call(1, "t:f"), general, &mut conn).await); // still 13 of 10: refused
        let left: Vec<String> = redis::cmd("HKEYS")
            .arg(&holds)
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut records = Vec::new();
        for c in [&a, &b] {
            let r: Option<String> = redis::cmd("GET")
                .arg(&c.record)
                .query_async(&mut conn)
                .await
                .unwrap();
            records.push(r);
        }
        seen.push((lines, left, records));
    }
    use AdmitCode::*;
    let codes: Vec<AdmitCode> = seen[0].0.iter().map(|l| l.0).collect();
    assert_eq!(
        codes,
        [
            Admitted, Admitted, Admitted, OverBudget, Admitted, Undone, Admitted, OverBudget,
            OverBudget
        ]
    );
    let remaining: Vec<i64> = seen[0].0.iter().map(|l| l.1).collect();
    assert_eq!(remaining, [6, 6, 2, 2, 2, 6, 2, 0, 0]);
    // The expired holds stay as tombstones (a late settling gives back what was not spent).
    let mut left = seen[0].1.clone();
    left.sort();
    assert_eq!(left, ["x:s1", "x:s2"]);
    assert_eq!(seen[0].2, [Some("1".to_string()), Some("u".to_string())]);
    assert_eq!(seen[0], seen[1], "admit_one (left) and admit (right)");
}

/// A hold whose settling arrives only after it expired in Redis (a failover or an outage
/// outlasted it) was charged in full by the call that saw it expire: the late settling gives
/// back what its instance did not spend, once, whether it comes alone (`settle`) or with the
/// key's next admission (`admit`). Before, the unspent units stayed charged.
#[tokio::test]
async fn a_settling_after_its_hold_expired_gives_back_what_was_not_spent() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(100, Duration::from_secs(3600), Duration::ZERO).unwrap();
    for (key, alone) in [(40u8, true), (41u8, false)] {
        let req = |cost| request(key, limit, vec![], cost);
        let call = |cost, id: &str| {
            admit_call(
                &req(cost),
                Ask::default(),
                id.into(),
                Duration::from_secs(60),
            )
        };
        let first = call(1, "t:first");
        let id = hold_field(0xabc);
        // The hash dates from before the grant, and the hold of 10 expired long ago.
        hset(&mut conn, &first.holds, "~", "@0").await;
        expired_hold(&mut conn, &first.holds, &id, 10).await;
        // Charged in full by the next admission: 10 + 1 of 100.
        assert_eq!(send(&first, false, &mut conn).await.1, 89);
        // Its instance spent 3 of the 10: 7 come back, once.
        for _ in 0..2 {
            if alone {
                settle(&mut conn, &first, &id, 7, IfLost::default()).await;
            } else {
                let mut c = call(1, &format!("t:with-settle-{}", rand::random::<u32>()));
                c.settle = 0xabc;
                c.unspent = 7;
                send(&c, true, &mut conn).await;
            }
        }
        // 3 + 1 spent, and the admissions that carried the settlings.
        let want = if alone { 95 } else { 93 };
        assert_eq!(
            send(&call(1, "t:last"), false, &mut conn).await.1,
            want,
            "key {key}"
        );
    }
}

/// A tombstone whose full charge has drained gives nothing back to a late settling (other
/// requests' charges are what the level holds now); and a settling of a hold Redis lost,
/// delivered three times, charges what was spent once (its tombstone answers every resend).
#[tokio::test]
async fn late_and_resent_settlings_never_give_back_or_charge_twice() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    // 1 unit per 36 s drains.
    let limit = Limit::new(100, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let call = |key: u8, id: &str| {
        admit_call(
            &request(key, limit, vec![], 1),
            Ask::default(),
            id.into(),
            Duration::from_secs(60),
        )
    };
    // Drained: 11 admitted, then a tombstone of 10 charged at an expiry 400 s ago (its
    // charge drained in 360 s) meets its settling with 7 not spent: nothing comes back.
    let first = call(50, "t:d0");
    for i in 0..11 {
        send(&call(50, &format!("t:d{i}")), false, &mut conn).await;
    }
    let t: Vec<i64> = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let now_us = t[0] * 1_000_000 + t[1];
    let id = hold_field(0xdd);
    let until = now_us - 400_000_000 + 60_000_000;
    hset(&mut conn, &first.holds, &id, &format!("0:{until}:10")).await;
    settle(&mut conn, &first, &id, 7, IfLost::default()).await;
    assert_eq!(send(&call(50, "t:d-last"), false, &mut conn).await.1, 88);

    // Lost: no hash at all (Redis lost its data); a hold of 10 granted at TIME 5, 3 not
    // spent. Sent three times (two answers lost): 7 charged, once.
    let lost = call(51, "t:l0");
    let id = hold_field(0x1057);
    for _ in 0..3 {
        settle(&mut conn, &lost, &id, 3, LOST).await;
    }
    assert_eq!(send(&lost, false, &mut conn).await.1, 100 - 7 - 1);
}

/// A refund of a request spent from a hold that is a tombstone by now (its units are in the
/// levels) goes to the budget: the lost hold's `0:<until>` tombstone once swallowed it.
#[tokio::test]
async fn a_refund_into_a_tombstoned_hold_goes_to_the_budget() {
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let limit = Limit::new(100, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let call = admit_call(
        &request(52, limit, vec![], 1),
        Ask::default(),
        "t:r0".into(),
        Duration::from_secs(60),
    );
    let budgets = call.budgets();
    let id = hold_field(0x2ef);
    // Redis lost the hold: its settling charges 7 and leaves a tombstone.
    settle(&mut conn, &call, &id, 3, LOST).await;
    // One of the 7 spent is refunded (its upstream failed): 6 charged, then this admission.
    let refund = Unspend {
        holds: &call.holds,
        budgets: &budgets,
        id: &id,
        cost: 1,
    };
    let r: i64 = script::invoke(&refund.invocation(), &mut conn)
        .await
        .unwrap();
    assert_eq!(r, 1);
    assert_eq!(send(&call, false, &mut conn).await.1, 100 - 6 - 1);
}

/// A thread's lane: the first `MAX_IN_FLIGHT` admissions are sent at once, the rest wait; a
/// call that lands takes what waited (in the order it came) as its next batch, and the lane
/// counts a call fewer in flight only when nothing waited for it.
#[test]
fn a_lane_sends_two_at_once_and_gathers_the_rest_in_order() {
    use super::{Lane, MAX_IN_FLIGHT};
    assert_eq!(MAX_IN_FLIGHT, 2);
    let limit = Limit::new(10, Duration::from_secs(3600), Duration::ZERO).unwrap();
    let req = request(1, limit, vec![], 1);
    let call = |id: &str| admit_call(&req, Ask::default(), id.into(), Duration::from_secs(60));
    let sent = || tokio::sync::oneshot::channel().0;
    let lane = Lane::default();
    // Whether admission `id` is sent at once (else it waits in the lane).
    let goes = |id: &str| lane.enter(call(id), sent()).is_some();
    let next = || -> Option<Vec<String>> {
        let batch = lane.next()?;
        Some(batch.into_iter().map(|(c, _)| c.lease_id).collect())
    };
    assert!(goes("a"), "the first goes at once");
    assert!(goes("b"), "and the second, beside it");
    for id in ["c", "d", "e"] {
        assert!(!goes(id), "{id} waits");
    }
    // The first call lands: what waited goes next, in the order it came.
    assert_eq!(next().unwrap(), ["c", "d", "e"]);
    // The second lands with nothing waiting: one call in flight now (the batch).
    assert_eq!(next(), None);
    assert!(goes("f"), "a second call may go again");
    assert!(!goes("g"), "two in flight: g waits");
    assert_eq!(next().unwrap(), ["g"]);
    assert_eq!(next(), None);
    assert_eq!(next(), None);
    // Idle: the next two go at once again.
    assert!(goes("h"));
    assert!(goes("i"));
}

mod reload;
