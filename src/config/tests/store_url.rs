//! `store.url`: what parses, what is refused, and that a password never shows.

use super::*;

fn with_redis(url: &str) -> String {
    format!("store:\n  backend: redis\n  url: \"{url}\"\n{BASE}")
}

#[test]
fn store_url_must_parse() {
    for url in [
        "redis://127.0.0.1:6379/abc",
        "redis://[::1",
        "redis://:99999",
        "redis://127.0.0.1:0",
        "redis://127.0.0.1:6379/-1",
        "redis://",
        "redis://0.0.0.0:6379",
        "http://127.0.0.1:6379",
    ] {
        let e = first_error(&with_redis(url));
        assert!(e.starts_with("store.url: "), "{url}: {e}");
    }
    for url in [
        "redis://127.0.0.1:6379/0",
        "redis://127.0.0.1",
        "redis://[::1]:6379",
        "rediss://user:pw@cache.internal:6380/2",
        "redis://:pw@localhost:6379/15",
    ] {
        let c = parse(&with_redis(url)).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(c.store.url, url);
    }
    // The memory backend never connects, but its url is checked all the same (below).
    assert!(parse(&format!("store:\n  url: \"redis://[::1\"\n{BASE}")).is_err());
}

#[test]
fn store_url_errors_never_show_the_password() {
    let e = first_error(&with_redis("redis://:hunter2@127.0.0.1:6379/abc"));
    assert!(e.starts_with("store.url: "), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
    let e = first_error(&with_redis("redis://u:hunter2@[::1:6379/0"));
    assert!(
        e.starts_with("store.url: ") && !e.contains("hunter2"),
        "{e}"
    );
}

#[test]
fn store_url_from_env_is_checked_too() {
    let env = EnvOverrides {
        redis_url: Some("redis://:hunter2@127.0.0.1:99999/0".into()),
        fleet_size: None,
    };
    let s = with_redis("redis://127.0.0.1:6379/0");
    let e = Config::parse(&s, &env).unwrap_err().0[0].to_string();
    assert!(e.starts_with("store.url: "), "{e}");
    assert!(e.contains("TOLLGATE_REDIS_URL"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
}

#[test]
fn cluster_and_sentinel_urls() {
    use super::url::{parse_redis_target, RedisTarget};
    assert_eq!(
        parse_redis_target("redis+cluster://10.0.0.1:7000,10.0.0.2").unwrap(),
        RedisTarget::Cluster {
            seeds: vec![
                "redis://10.0.0.1:7000".into(),
                "redis://10.0.0.2:6379".into()
            ]
        }
    );
    assert_eq!(
        parse_redis_target("rediss+cluster://:pw@[::1]:7000,h2:7001/").unwrap(),
        RedisTarget::Cluster {
            seeds: vec![
                "rediss://:pw@[::1]:7000".into(),
                "rediss://:pw@h2:7001".into()
            ]
        }
    );
    assert_eq!(
        parse_redis_target("rediss+sentinel://u:pw@s1,s2:5000/my-master/2").unwrap(),
        RedisTarget::Sentinel {
            sentinels: vec!["rediss://s1:26379".into(), "rediss://s2:5000".into()],
            master: "my-master".into(),
            primary: "rediss://u:pw@sentinel-named/2".into(),
        }
    );
    for url in [
        "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
        "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster",
        "rediss+cluster://:pw@10.0.0.1:6379",
    ] {
        let s = with_redis(url);
        assert!(Config::parse(&s, &EnvOverrides::default()).is_ok(), "{url}");
    }
    for (url, why) in [
        ("redis+cluster://h1:6379,,h2:6379", "needs a host"),
        ("redis+cluster://:pw@h1:6379,h2:0", "port"),
        ("redis+cluster://h1:6379/3", "only database 0"),
        ("redis+cluster://h1:6379?x=1", "no query"),
        ("redis+sentinel://:pw@h1:26379", "name the master"),
        ("redis+sentinel://h1:26379/a b", "name the master"),
        ("redis+sentinel://:pw@h1:26379/m/x", "database"),
        ("redis+clusterx://h1", "must start with"),
    ] {
        let e = first_error(&with_redis(url));
        assert!(
            e.starts_with("store.url: ") && e.contains(why),
            "{url}: {e}"
        );
        assert!(!e.contains(":pw@"), "{e}");
    }
}

#[test]
fn a_password_with_a_slash_is_redacted_too() {
    assert_eq!(
        super::redact_url("redis://:pa/ss@h:6379/0"),
        "redis://:***@h:6379/0"
    );
    assert_eq!(
        super::redact_url("redis://u:p@h:6379/0"),
        "redis://u:***@h:6379/0"
    );
    assert_eq!(super::redact_url("redis://h:6379/0"), "redis://h:6379/0");
}

/// A mistyped scheme separator (`redis:/`, `redis//`, none) hides the password as well: the
/// error that refuses such a URL quotes it.
#[test]
fn a_password_behind_a_mistyped_scheme_is_redacted() {
    for (url, shown) in [
        (
            "redis:/:hunter2pw@10.0.0.1:6379/0",
            "redis:/:***@10.0.0.1:6379/0",
        ),
        ("redis//:hunter2pw@h:1/0", "redis//:***@h:1/0"),
        ("redis:hunter2pw@h:1/0", "redis:***@h:1/0"),
        (":hunter2pw@h:1", ":***@h:1"),
        ("u:hunter2pw@h:1", "u:***@h:1"),
    ] {
        assert_eq!(super::redact_url(url), shown, "{url}");
        let e = first_error(&with_redis(url));
        assert!(
            e.starts_with("store.url: ") && !e.contains("hunter2pw"),
            "{e}"
        );
    }
}

/// DESIGN §1: a `store.url` that cannot be parsed is an error whatever the backend (the
/// memory store does not read it, but a file that says it is wrong).
#[test]
fn store_url_must_parse_on_the_memory_store_too() {
    let s = format!("store:\n  url: \"redis://h:notaport/0\"\n{BASE}");
    let e = first_error(&s);
    assert!(e.starts_with("store.url: "), "{e}");
    let s = format!("store:\n  backend: memory\n  url: \"redis://127.0.0.1:6379/0\"\n{BASE}");
    assert!(Config::parse(&s, &EnvOverrides::default()).is_ok());
}

/// A multi-host URL carries one set of credentials, before its hosts: credentials per host
/// would make the first host part of the password.
#[test]
fn credentials_per_host_are_refused() {
    for url in [
        "redis+cluster://:pw1@h1:1,:pw2@h2:2",
        "redis+sentinel://u:a@h1:1,u:b@h2:2/mymaster",
    ] {
        let e = first_error(&with_redis(url));
        assert!(
            e.starts_with("store.url: cannot be used: give the credentials once"),
            "{e}"
        );
        assert!(!e.contains("pw1") && !e.contains("u:a@"), "{e}");
    }
    assert!(parse(&with_redis("redis+cluster://:p%40w@h1:1,h2:2")).is_ok());
    // A raw '@' in the credentials, with no host list inside them, is read up to the last '@'.
    assert!(parse(&with_redis("redis+cluster://:p@ss@h1:1,h2:2")).is_ok());
    assert!(parse(&with_redis("redis+cluster://me@corp.com:pw@h1:1,h2:2")).is_ok());
}
