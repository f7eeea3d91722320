//! TLS termination (`server.tls`): the certificate and key, read and checked once per config
//! load, and the resolver the TLS listener asks for them on every handshake.
//!
//! Pingora builds its rustls acceptor once, when the listener starts, and panics on a file it
//! cannot use. So the files are read here, while the config is validated (`tollgate check`
//! reports the same errors, with their field paths), and the listener is given a
//! [`CertResolver`] instead of the paths: a reload that reads a good pair swaps it in for new
//! handshakes; a bad pair fails the whole reload, and the running certificate stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora::listeners::tls::TlsSettings;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::{CertificateDer, ClientHello, PrivateKeyDer, ResolvesServerCert, RusTlsError};
use rustls_pki_types::pem::{self, PemObject};

/// `server.tls` as the gateway runs it.
#[derive(Debug, Clone)]
pub struct TlsListener {
    pub listen: String,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The chain and key as read from `cert` and `key` when the config was loaded.
    pub certified: Arc<CertifiedKey>,
}

/// Why a certificate/key pair cannot be served. Each names the file it is about, so that the
/// config error can carry the right field path.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The chain file (`server.tls.cert`) is unreadable or holds no usable certificate.
    #[error("{0}")]
    Cert(String),
    /// The key file (`server.tls.key`) is unreadable or holds no usable private key.
    #[error("{0}")]
    Key(String),
    /// The key is not the one of the chain's first certificate.
    #[error("the private key does not match the certificate in \"{0}\"")]
    Mismatch(String),
}

impl TlsError {
    /// The field of `server.tls` the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            TlsError::Cert(_) => "server.tls.cert",
            TlsError::Key(_) | TlsError::Mismatch(_) => "server.tls.key",
        }
    }
}

fn pem_error(path: &Path, what: &str, e: pem::Error) -> String {
    let path = crate::config::shown_path(&path.display().to_string());
    match e {
        pem::Error::Io(e) => format!("cannot read {path}: {e}"),
        pem::Error::NoItemsFound => format!("no {what} in {path} (expected PEM)"),
        e => format!("{path} is not valid PEM: {e}"),
    }
}

/// A PEM file's bytes, up to the bound a config file has: a device or a pipe named for one
/// (`/dev/zero`) is refused there instead of read without end.
fn read_pem(path: &Path) -> Result<Vec<u8>, pem::Error> {
    let bytes = crate::config::read_bounded(path).map_err(pem::Error::Io)?;
    if bytes.len() > 4 << 20 {
        return Err(pem::Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "more than 4 MiB, not a PEM file",
        )));
    }
    Ok(bytes)
}

/// Reads a PEM private key (`server.tls.key`).
pub fn read_key(key: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    read_pem(key)
        .and_then(|bytes| PrivateKeyDer::from_pem_slice(&bytes))
        .map_err(|e| TlsError::Key(pem_error(key, "private key", e)))
}

/// Reads a PEM chain (leaf first) and its private key, and checks that they belong together.
pub fn load_key_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain: Vec<CertificateDer<'static>> = read_pem(cert)
        .and_then(|bytes| CertificateDer::pem_slice_iter(&bytes).collect())
        .map_err(|e| TlsError::Cert(pem_error(cert, "certificate", e)))?;
    if chain.is_empty() {
        return Err(TlsError::Cert(pem_error(
            cert,
            "certificate",
            pem::Error::NoItemsFound,
        )));
    }
    let private = read_key(key)?;
    pingora::tls::install_default_crypto_provider();
    let Some(provider) = pingora::tls::CryptoProvider::get_default() else {
        return Err(TlsError::Key("no TLS crypto provider is installed".into()));
    };
    CertifiedKey::from_der(chain, private, provider).map_err(|e| match e {
        RusTlsError::InconsistentKeys(_) => TlsError::Mismatch(cert.display().to_string()),
        RusTlsError::InvalidCertificate(e) => TlsError::Cert(format!(
            "\"{}\" does not hold a valid certificate: {e:?}",
            cert.display()
        )),
        e => TlsError::Key(format!("\"{}\": {e}", key.display())),
    })
}

/// Serves whichever certificate was loaded last.
#[derive(Debug)]
pub struct CertResolver(ArcSwap<CertifiedKey>);

impl CertResolver {
    pub fn new(certified: Arc<CertifiedKey>) -> Arc<CertResolver> {
        Arc::new(CertResolver(ArcSwap::new(certified)))
    }

    /// New handshakes get `certified`; connections already open keep theirs.
    pub fn replace(&self, certified: Arc<CertifiedKey>) {
        self.0.store(certified);
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// The listener's settings: certificates from `resolver`, ALPN `h2` then `http/1.1`. Pingora
/// always limits its rustls acceptor to TLS 1.2 and 1.3.
pub fn settings(resolver: Arc<CertResolver>) -> pingora::Result<TlsSettings> {
    // The paths are never read once a resolver is set.
    let mut s = TlsSettings::intermediate("", "")?;
    s.set_cert_resolver(resolver);
    s.enable_h2();
    Ok(s)
}

/// A self-signed `localhost` pair written as `<name>.crt` and `<name>.key` in `dir` (tests).
#[cfg(test)]
pub(crate) fn test_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (c, k) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_pair as write_pair;

    #[test]
    fn the_resolver_serves_the_last_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (c1, k1) = write_pair(dir.path(), "a");
        let (c2, k2) = write_pair(dir.path(), "b");
        let first = Arc::new(load_key_pair(&c1, &k1).unwrap());
        let second = Arc::new(load_key_pair(&c2, &k2).unwrap());
        let r = CertResolver::new(first.clone());
        assert!(Arc::ptr_eq(&r.0.load_full(), &first));
        r.replace(second.clone());
        assert!(Arc::ptr_eq(&r.0.load_full(), &second));
    }
}
