//! `tollgate audit`'s side of `/admin/audit`: one blocking-enough GET per instance (a small
//! current-thread runtime in the CLI), each bounded by a timeout, each failure named.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;

use super::InstanceAudit;

/// How long one instance may take to answer.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why one instance's report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("not an http:// admin URL: {0}")]
    Url(String),
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("no answer within {}s", FETCH_TIMEOUT.as_secs())]
    Timeout,
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("answered {0} (set TOLLGATE_ADMIN_TOKEN if the admin API needs a token)")]
    Status(u16),
    #[error("not an audit report: {0}")]
    Body(#[from] serde_json::Error),
    #[error("the fetch ended early: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// `http://host:port[/prefix]` → the `/admin/audit` URL's parts.
fn target(base: &str) -> Result<(String, u16, String, String), FetchError> {
    let url = url::Url::parse(base).map_err(|e| FetchError::Url(format!("{base}: {e}")))?;
    if url.scheme() != "http" {
        return Err(FetchError::Url(base.to_string()));
    }
    let host = url
        .host_str()
        .ok_or_else(|| FetchError::Url(base.to_string()))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = url.port().unwrap_or(80);
    let authority = match url.port() {
        Some(p) => format!("{}:{p}", url.host_str().unwrap_or_default()),
        None => url.host_str().unwrap_or_default().to_string(),
    };
    let path = format!("{}/admin/audit", url.path().trim_end_matches('/'));
    Ok((host, port, authority, path))
}

/// Reads one instance's `/admin/audit`, with `token` as its bearer token when given.
pub async fn fetch(base: &str, token: Option<&str>) -> Result<InstanceAudit, FetchError> {
    let (host, port, authority, path) = target(base)?;
    let get = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(FetchError::Connect)?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let mut req = hyper::Request::get(path).header(hyper::header::HOST, authority);
        if let Some(t) = token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req
            .body(Empty::<Bytes>::new())
            .map_err(|e| FetchError::Url(e.to_string()))?;
        let resp = send.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            return Err(FetchError::Status(status.as_u16()));
        }
        Ok(serde_json::from_slice(&body)?)
    };
    tokio::time::timeout(FETCH_TIMEOUT, get)
        .await
        .map_err(|_| FetchError::Timeout)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_urls() {
        let (h, p, a, path) = target("http://127.0.0.1:9901").unwrap();
        assert_eq!(
            (h.as_str(), p, a.as_str(), path.as_str()),
            ("127.0.0.1", 9901, "127.0.0.1:9901", "/admin/audit")
        );
        let (_, p, _, path) = target("http://gw.internal/tollgate/").unwrap();
        assert_eq!((p, path.as_str()), (80, "/tollgate/admin/audit"));
        let (h, ..) = target("http://[::1]:9901").unwrap();
        assert_eq!(h, "::1");
        assert!(matches!(target("https://x:1"), Err(FetchError::Url(_))));
        assert!(matches!(target("127.0.0.1:9901"), Err(FetchError::Url(_))));
    }
}
