//! PKI for TLS tests: a CA of the test's own and a leaf certificate it signed.

use std::path::PathBuf;

/// A CA of the test's own and a certificate for `localhost` signed by it, written as PEM files.
pub struct Pki {
    pub ca_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub cert_der: Vec<u8>,
    pub key_der: Vec<u8>,
}

impl Pki {
    pub fn new(dir: &std::path::Path) -> Pki {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tollgate test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let pki = Pki {
            ca_file: dir.join("ca.pem"),
            cert_file: dir.join("cert.pem"),
            key_file: dir.join("key.pem"),
            cert_der: leaf.der().to_vec(),
            key_der: leaf_key.serialize_der(),
        };
        std::fs::write(&pki.ca_file, ca_cert.pem()).unwrap();
        std::fs::write(&pki.cert_file, leaf.pem()).unwrap();
        std::fs::write(&pki.key_file, leaf_key.serialize_pem()).unwrap();
        pki
    }
}
