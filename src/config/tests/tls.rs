//! `server.tls` as `tollgate check` sees it: a pair that cannot be served is named by its field.

use super::*;
use crate::tls::test_pair as write_pair;
use std::path::Path;

fn errors(cert: &Path, key: &Path) -> Vec<String> {
    let y = format!(
        "server:\n  tls: {{listen: \"127.0.0.1:8443\", cert: \"{}\", key: \"{}\"}}\nupstream: {{url: \"http://127.0.0.1:1\"}}\nrate_limits:\n  default: {{window: 60s, max_cost: 120}}\n",
        cert.display(),
        key.display()
    );
    match Config::parse(&y, &EnvOverrides::default()) {
        Ok(c) => {
            assert!(c.tls.is_some());
            vec![]
        }
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

#[test]
fn check_names_the_file_that_cannot_be_served() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(dir.path(), "a");
    let (_, other_key) = write_pair(dir.path(), "b");
    assert_eq!(errors(&cert, &key), Vec::<String>::new());

    let missing = dir.path().join("missing.crt");
    let e = errors(&missing, &key);
    assert!(
        e[0].starts_with(&format!(
            "server.tls.cert: cannot read \"{}\"",
            missing.display()
        )),
        "{e:?}"
    );
    // A key where the chain should be, and the other way round.
    let e = errors(&key, &key);
    assert!(
        e[0].starts_with("server.tls.cert: no certificate in"),
        "{e:?}"
    );
    let e = errors(&cert, &cert);
    assert!(
        e[0].starts_with("server.tls.key: no private key in"),
        "{e:?}"
    );
    let e = errors(&cert, &other_key);
    assert_eq!(
        e,
        vec![format!(
            "server.tls.key: the private key does not match the certificate in \"{}\"",
            cert.display()
        )]
    );
    // Neither file there: both are reported, not the certificate alone.
    let missing_key = dir.path().join("missing.key");
    let e = errors(&missing, &missing_key);
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(e[0].starts_with("server.tls.cert: cannot read"), "{e:?}");
    assert!(e[1].starts_with("server.tls.key: cannot read"), "{e:?}");
    let garbage = dir.path().join("garbage.crt");
    std::fs::write(
        &garbage,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let e = errors(&garbage, &key);
    assert!(e[0].starts_with("server.tls.cert: "), "{e:?}");
}

/// A cert or key path whose size the file system does not know is read up to a bound and
/// refused there: `tls.cert: /dev/zero` read without end.
#[test]
fn an_endless_pem_file_is_refused_at_a_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(dir.path(), "a");
    let zero = Path::new("/dev/zero");
    let e = errors(zero, &key);
    assert_eq!(
        e,
        ["server.tls.cert: cannot read \"/dev/zero\": more than 4 MiB, not a PEM file"]
    );
    let e = errors(&cert, zero);
    assert_eq!(
        e,
        ["server.tls.key: cannot read \"/dev/zero\": more than 4 MiB, not a PEM file"]
    );
}
