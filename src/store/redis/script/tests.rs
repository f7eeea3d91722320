use super::*;

/// Only answers that prove the script did not run are resent, or count as "not run".
#[test]
fn what_is_resent_and_what_counts_as_not_run() {
    use redis::{ErrorKind, ServerErrorKind as K};
    let server = |k| RedisError::from((ErrorKind::Server(k), "x"));
    assert!(stale_topology(&server(K::Moved)));
    assert!(stale_topology(&server(K::ReadOnly)));
    for k in [K::Ask, K::TryAgain, K::ClusterDown, K::NoScript] {
        assert!(!stale_topology(&server(k)), "{k:?}");
    }
    for k in [
        K::Moved,
        K::Ask,
        K::TryAgain,
        K::ClusterDown,
        K::MasterDown,
        K::ReadOnly,
        K::ResponseError,
    ] {
        assert!(refused_before_running(&server(k)), "{k:?}");
    }
    // An error code redis-rs does not know (OOM): an error reply all the same.
    let oom = RedisError::from((ErrorKind::Extension, "OOM", "command not allowed".into()));
    assert!(refused_before_running(&oom) && !stale_topology(&oom));
    let dropped = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
    for e in [dropped, timeout] {
        assert!(!stale_topology(&e) && !refused_before_running(&e), "{e}");
    }
}

/// An admission resent after its connection broke: when the resend is refused (the node is
/// gone, or moved), the first failure stands if that call may have run, so that its admission
/// is undone by its id; the Cluster failover test once charged a request twice without this.
#[test]
fn a_refused_resend_keeps_the_failure_that_may_have_run() {
    use std::io::ErrorKind::{ConnectionRefused, ConnectionReset, TimedOut};
    let io = |k| RedisError::from(std::io::Error::from(k));
    let moved = || RedisError::from((redis::ErrorKind::Server(redis::ServerErrorKind::Moved), "x"));
    let which = |r: redis::RedisResult<u8>| {
        let e = r.unwrap_err();
        match () {
            _ if e.is_connection_refusal() => "refused",
            _ if e.is_timeout() => "timed out",
            _ if e.is_connection_dropped() => "reset",
            _ => "other",
        }
    };
    assert_eq!(
        which(after_resend(
            io(ConnectionReset),
            Err(io(ConnectionRefused))
        )),
        "reset"
    );
    assert_eq!(
        which(after_resend(io(ConnectionReset), Err(moved()))),
        "reset"
    );
    // A resend that may have run itself, or that was answered, speaks for both sends.
    assert_eq!(
        which(after_resend(io(ConnectionReset), Err(io(TimedOut)))),
        "timed out"
    );
    assert_eq!(after_resend(io(ConnectionReset), Ok(5u8)).unwrap(), 5);
    // Neither ran: the resend's refusal.
    assert_eq!(
        which(after_resend(
            io(ConnectionRefused),
            Err(io(ConnectionRefused))
        )),
        "refused"
    );
}

/// The Rust names and the Lua constants agree: `local OVER_BUDGET, ... = 0, ...`.
#[test]
fn admit_codes_match_the_script() {
    let lua = SOURCES[Lua::Admit as usize].1;
    let line = lua
        .lines()
        .find(|l| l.starts_with("local OVER_BUDGET"))
        .expect("the script names its reply codes");
    let (names, values) = line["local ".len()..].split_once('=').unwrap();
    let lua_codes: Vec<(String, i64)> = names
        .split(',')
        .map(|n| n.trim().to_string())
        .zip(values.split(',').map(|v| v.trim().parse().unwrap()))
        .collect();
    let rust_codes: Vec<(String, i64)> = AdmitCode::ALL
        .iter()
        .map(|c| {
            let camel = format!("{c:?}");
            let mut snake = String::new();
            for (i, ch) in camel.chars().enumerate() {
                if ch.is_uppercase() && i > 0 {
                    snake.push('_');
                }
                snake.push(ch.to_ascii_uppercase());
            }
            (snake, *c as i64)
        })
        .collect();
    assert_eq!(lua_codes, rust_codes);
    for (name, _) in &lua_codes {
        assert!(
            lua.contains(&format!("return reply({name},")),
            "{name} is returned"
        );
    }
    assert_eq!(AdmitCode::from_reply(3), Some(AdmitCode::Admitted));
    assert_eq!(AdmitCode::from_reply(4), Some(AdmitCode::Undone));
    assert_eq!(AdmitCode::from_reply(5), None);
}

/// Each operation's script is flagged (`#!lua` first: Redis refuses it unrun when it could not
/// write) and is the one its name says, in the order of [`Lua`].
#[test]
fn every_operation_has_a_flagged_script_of_its_own() {
    let all = [
        Lua::Admit,
        Lua::AdmitOne,
        Lua::Undo,
        Lua::Refund,
        Lua::Debit,
        Lua::Settle,
        Lua::Unspend,
        Lua::Peek,
        Lua::Lease,
        Lua::AdmitBatch,
    ];
    assert_eq!(all.len(), SOURCES.len());
    for l in all {
        let (name, lua) = SOURCES[l as usize];
        let snake = format!("{l:?}")
            .chars()
            .enumerate()
            .flat_map(|(i, c)| {
                let sep = (i > 0 && c.is_uppercase()).then_some('_');
                sep.into_iter()
                    .chain(std::iter::once(c.to_ascii_lowercase()))
            })
            .collect::<String>();
        assert_eq!(name, snake);
        assert!(lua.starts_with("#!lua\n"), "{name}");
        let flags = lua.lines().filter(|l| l.starts_with("#!")).count();
        assert_eq!(flags, 1, "{name}");
        assert!(lua.contains(&format!("\n-- {name}: ")), "{name}'s contract");
    }
}

/// Packed replies (`pack.lua`): a count, then that many little-endian i64s, call after call.
#[test]
fn packed_replies_unpack_exactly_or_not_at_all() {
    fn pack(calls: &[&[i64]]) -> Vec<u8> {
        let mut b = Vec::new();
        for c in calls {
            b.extend_from_slice(&(c.len() as i64).to_le_bytes());
            for v in *c {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }
    let now = 1_764_864_000_123_456_i64; // µs: past 2^32, as Redis TIME is
    let calls: [&[i64]; 3] = [&[3, 0, 5, 1000, 0, now, 10, 0], &[-1], &[]];
    let bytes = pack(&calls);
    let want: Vec<Vec<i64>> = calls.iter().map(|c| c.to_vec()).collect();
    assert_eq!(unpack(&bytes), Some(want.clone()));
    let value = Value::BulkString(bytes.clone());
    assert_eq!(Packed::from_redis_value_ref(&value).unwrap(), Packed(want));
    // A call sent alone answers exactly one reply.
    let one = Packed::from_redis_value(Value::BulkString(pack(&calls[..1]))).unwrap();
    assert_eq!(one.one().unwrap(), calls[0].to_vec());
    let two = Packed::from_redis_value(Value::BulkString(pack(&calls[..2]))).unwrap();
    assert!(two.one().is_err());
    // Cut anywhere inside a word, or with bytes left over, or a count past the end: refused.
    for cut in (1..bytes.len()).filter(|n| n % 8 != 0) {
        assert_eq!(unpack(&bytes[..cut]), None, "cut at {cut}");
    }
    assert_eq!(unpack(&pack(&[&[7, 8, 9]])[..24]), None);
    let mut huge = pack(&[&[1]]);
    huge[..8].copy_from_slice(&i64::MAX.to_le_bytes());
    assert_eq!(unpack(&huge), None);
    huge[..8].copy_from_slice(&(-2_i64).to_le_bytes());
    assert_eq!(unpack(&huge), None);
    // Not a string: what an old script (an array of integers) would answer.
    let array = Value::Array(vec![Value::Int(3), Value::Int(0)]);
    assert!(Packed::from_redis_value_ref(&array).is_err());
}

/// A call goes on the wire as `EVALSHA sha numkeys KEYS... ARGV...`, whatever order its keys
/// and arguments were laid in.
#[test]
fn a_call_is_sent_as_evalsha_with_its_keys_before_its_arguments() {
    let script = Script::new("return 1");
    let mut call = Call::new(&script);
    call.key("t{a}b")
        .arg(500_000_u64)
        .arg("id:1")
        .key("t{a}h")
        .arg(&b"\x00\xff"[..]);
    let mut want = redis::cmd("EVALSHA");
    want.arg(script.get_hash())
        .arg(2)
        .arg("t{a}b")
        .arg("t{a}h")
        .arg("500000")
        .arg("id:1")
        .arg(&b"\x00\xff"[..]);
    assert_eq!(call.eval().get_packed_command(), want.get_packed_command());
}
