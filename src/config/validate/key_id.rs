//! `identity.key_id_header`: the header that carries the key's id to the upstream.

use crate::config::bounds::shown;
use crate::config::IdentitySource;

/// Why a header cannot carry the key id; each names the header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum KeyIdHeaderError {
    /// The name as written, shortened for display.
    #[error("not a valid header name: \"{0}\"")]
    Invalid(String),
    #[error("\"{0}\" is an identity source (identity.sources): the key id cannot replace the key")]
    IdentitySource(String),
    #[error("authorization carries credentials; choose another header")]
    Authorization,
    #[error("\"{0}\" is a framing header of the request; choose another header")]
    Framing(String),
    #[error("\"{0}\" is a header the gateway sets itself (or another spelling of one, the same variable to a CGI-style server); choose another header")]
    GatewaySet(String),
}

/// "" is none. Otherwise a header the gateway may set on the upstream request: not one that
/// carries a key (it would be overwritten by, or leak into, credentials) nor one that frames
/// the request.
pub(super) fn key_id_header(
    name: &str,
    sources: &[IdentitySource],
) -> Result<Option<http::HeaderName>, KeyIdHeaderError> {
    if name.is_empty() {
        return Ok(None);
    }
    let header = http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| KeyIdHeaderError::Invalid(shown(name)))?;
    let is_source = sources
        .iter()
        .any(|s| matches!(s, IdentitySource::Header(h) if *h == header));
    if is_source {
        return Err(KeyIdHeaderError::IdentitySource(name.into()));
    }
    if header == http::header::AUTHORIZATION {
        return Err(KeyIdHeaderError::Authorization);
    }
    match reserved(&header) {
        Some(Reserved::Framing) => Err(KeyIdHeaderError::Framing(name.into())),
        Some(Reserved::GatewaySet) => Err(KeyIdHeaderError::GatewaySet(name.into())),
        None => Ok(Some(header)),
    }
}

/// Headers no setting may give another meaning to.
enum Reserved {
    /// It frames the request.
    Framing,
    /// The gateway sets it on every forwarded request, in any spelling (`proxy::scrub`): a
    /// value of the client's is replaced or removed (and the request id is logged).
    GatewaySet,
}

fn reserved(header: &http::HeaderName) -> Option<Reserved> {
    const FRAMING: [http::HeaderName; 4] = [
        http::header::HOST,
        http::header::CONTENT_LENGTH,
        http::header::TRANSFER_ENCODING,
        http::header::CONNECTION,
    ];
    if FRAMING.contains(header) {
        Some(Reserved::Framing)
    } else if crate::proxy::set_by_gateway(header.as_str()) {
        Some(Reserved::GatewaySet)
    } else {
        None
    }
}

/// Why a header cannot carry the API key (`identity.sources`); each names the header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum SourceHeaderError {
    #[error("\"{0}\" is a framing header of the request; the key cannot be read from it")]
    Framing(String),
    #[error("\"{0}\" is a header the gateway sets itself (or another spelling of one): the key would be logged or replaced with the gateway's value; choose another header")]
    GatewaySet(String),
}

/// A header the key may be read from: not one that frames the request, nor one the gateway
/// sets, logs (the request id) or replaces with its own value upstream.
pub(super) fn source_header(
    name: &str,
    header: &http::HeaderName,
) -> Result<(), SourceHeaderError> {
    match reserved(header) {
        Some(Reserved::Framing) => Err(SourceHeaderError::Framing(name.into())),
        Some(Reserved::GatewaySet) => Err(SourceHeaderError::GatewaySet(name.into())),
        None => Ok(()),
    }
}
