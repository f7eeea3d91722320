//! A late upstream answer, followed to its end after the gateway stopped waiting for it.
//!
//! A capped request keeps its slot until the upstream has finished its answer (DESIGN §3),
//! although the client already got its 504 at `read_timeout`, or an HTTP/2 client reset its
//! stream. Pingora drops its upstream connection then; the socket stays open through a
//! duplicate of its descriptor, and this reads (and discards) what the upstream still sends.
//! Nothing is written to the upstream: it finishes the request as it would have, and the
//! answer's own framing (`Content-Length`, chunked) says when it is over — an upstream keeps
//! a kept-alive connection open after answering, so its end of file would come late or never.

use std::io;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What is known of the answer still to come on the duplicated connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateAnswer {
    /// Nothing of the answer has been read: it is parsed from its first byte (`head`: the
    /// request was a HEAD, so the answer has no body whatever its headers say).
    Whole { head: bool },
    /// Part of it may have been read already: read until the upstream closes (the request
    /// went with `Connection: close`).
    UntilClose,
}

/// The most bytes a late answer's head may take before it is read as "until close".
const MAX_HEAD: usize = 64 * 1024;

/// What following a late answer learned of it (a whole one's, `LateAnswer::Whole`): when its
/// (final) head arrived, and the value of the header `stated` names, the cost the upstream
/// states (`cost_from_response`).
#[derive(Debug, Default)]
pub struct Learned {
    pub head_at: Option<std::time::Instant>,
    /// Every value the header had (`Report::read` judges repeats).
    pub stated: Vec<http::HeaderValue>,
    /// When following a whole answer ended without its head (the upstream closed, or
    /// `abandon_timeout` came): until then the upstream was at work on it, as far as anyone
    /// can tell, and its slot was held.
    pub ended_headless_at: Option<std::time::Instant>,
}

/// Reads the rest of the upstream's answer from `dup` (until it ends, the upstream closes,
/// or `deadline` — `abandon_timeout` after the request was sent), then runs `release`; what
/// it learned of the answer's head (the header `stated` names, if any).
pub async fn drain_upstream(
    dup: std::os::fd::OwnedFd,
    deadline: Instant,
    answer: LateAnswer,
    stated: Option<&http::HeaderName>,
    release: impl std::future::Future<Output = ()>,
) -> Learned {
    let mut learned = Learned::default();
    // The duplicate shares the original's open file description, so it is non-blocking too.
    match TcpStream::from_std(std::net::TcpStream::from(dup)) {
        Ok(mut upstream) => {
            let read = async {
                match answer {
                    LateAnswer::Whole { head } => {
                        read_answer(&mut upstream, head, stated, &mut learned).await
                    }
                    LateAnswer::UntilClose => until_close(&mut upstream).await,
                }
            };
            match tokio::time::timeout_at(deadline, read).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "a late upstream answer ended early"),
                Err(_) => tracing::info!("gave up on a late upstream answer at abandon_timeout"),
            }
            if matches!(answer, LateAnswer::Whole { .. }) && learned.head_at.is_none() {
                learned.ended_headless_at = Some(std::time::Instant::now());
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot follow a late upstream answer"),
    }
    release.await;
    learned
}

/// How the body of a parsed head is delimited.
enum Body {
    /// A `1xx` interim answer: the real one follows.
    Interim,
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

/// One HTTP/1 answer, from its first byte to its last; its final head's arrival and the
/// header `stated` names go into `learned`.
async fn read_answer(
    up: &mut TcpStream,
    head_request: bool,
    stated: Option<&http::HeaderName>,
    learned: &mut Learned,
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    loop {
        let (head_len, body) = loop {
            match parse_head(&buf, head_request, stated) {
                Ok(Some((len, body, values))) => {
                    if !matches!(body, Body::Interim) {
                        learned.head_at = Some(std::time::Instant::now());
                        learned.stated = values;
                    }
                    break (len, body);
                }
                Ok(None) if buf.len() < MAX_HEAD => {
                    if read_more(up, &mut buf).await? == 0 {
                        return Ok(());
                    }
                }
                // Not an answer's head after all (or a huge one): wait for the close.
                _ => return until_close(up).await,
            }
        };
        buf.drain(..head_len);
        return match body {
            Body::Interim => continue,
            Body::None => Ok(()),
            Body::Length(n) => skip(up, &mut buf, n).await,
            Body::Chunked => chunked(up, buf).await,
            Body::UntilClose => until_close(up).await,
        };
    }
}

/// A parsed head: its length, how its body ends, the values of the header asked for.
type Head = (usize, Body, Vec<http::HeaderValue>);

/// The head's length, how its body ends and the values of header `stated` (one that is not
/// a header value at all stands as one that is no plain integer: not believed), once the head
/// is complete (`None` before).
fn parse_head(
    buf: &[u8],
    head_request: bool,
    stated: Option<&http::HeaderName>,
) -> Result<Option<Head>, ()> {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut resp = httparse::Response::new(&mut headers);
    let n = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(()),
    };
    let status = resp.code.unwrap_or(0);
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
    };
    let body = if (100..200).contains(&status) && status != 101 {
        Body::Interim
    } else if head_request || status == 204 || status == 304 {
        Body::None
    } else if header("transfer-encoding").is_some_and(|v| {
        v.rsplit(|b| *b == b',')
            .next()
            .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
    }) {
        Body::Chunked
    } else if let Some(len) = header("content-length") {
        std::str::from_utf8(len)
            .ok()
            .and_then(|l| l.trim().parse().ok())
            .map_or(Body::UntilClose, Body::Length)
    } else {
        Body::UntilClose
    };
    let values = stated.map_or_else(Vec::new, |name| {
        resp.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name.as_str()))
            .map(|h| {
                http::HeaderValue::from_bytes(h.value)
                    .unwrap_or_else(|_| http::HeaderValue::from_static("-"))
            })
            .collect()
    });
    Ok(Some((n, body, values)))
}

async fn read_more(up: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    let mut chunk = [0u8; 8192];
    let n = up.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

/// Discards `n` bytes: those already in `buf` first.
async fn skip(up: &mut TcpStream, buf: &mut Vec<u8>, mut n: u64) -> io::Result<()> {
    let have = (buf.len() as u64).min(n);
    buf.drain(..have as usize);
    n -= have;
    let mut scratch = vec![0u8; 16 * 1024];
    while n > 0 {
        let want = scratch.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        match up.read(&mut scratch[..want]).await? {
            0 => return Ok(()),
            got => n -= got as u64,
        }
    }
    Ok(())
}

/// A chunked body: chunks until the last (size 0), then the trailer section.
async fn chunked(up: &mut TcpStream, mut buf: Vec<u8>) -> io::Result<()> {
    loop {
        let size = loop {
            match httparse::parse_chunk_size(&buf) {
                Ok(httparse::Status::Complete((used, size))) => {
                    buf.drain(..used);
                    break size;
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {
                    if read_more(up, &mut buf).await? == 0 {
                        return Ok(());
                    }
                }
                _ => return until_close(up).await,
            }
        };
        if size == 0 {
            return trailers(up, buf).await;
        }
        // The chunk's data and the CRLF after it.
        skip(up, &mut buf, size.saturating_add(2)).await?;
    }
}

/// Trailer lines up to the empty line that ends the answer.
async fn trailers(up: &mut TcpStream, mut buf: Vec<u8>) -> io::Result<()> {
    loop {
        if let Some(end) = buf.windows(2).position(|w| w == b"\r\n") {
            if end == 0 {
                return Ok(());
            }
            buf.drain(..end + 2);
            continue;
        }
        if buf.len() >= MAX_HEAD || read_more(up, &mut buf).await? == 0 {
            return Ok(());
        }
    }
}

/// Everything until the upstream closes the connection.
async fn until_close(up: &mut TcpStream) -> io::Result<()> {
    let mut scratch = vec![0u8; 16 * 1024];
    while up.read(&mut scratch).await? > 0 {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Writes `parts` with pauses to a socket that stays open afterwards; returns whether
    /// `read_answer` finished (within the second it is given).
    async fn ends(parts: &[&[u8]], head_request: bool) -> bool {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let parts: Vec<Vec<u8>> = parts.iter().map(|p| p.to_vec()).collect();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            for p in parts {
                s.write_all(&p).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            // Kept alive: no end of file.
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let done = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            read_answer(&mut c, head_request, None, &mut Learned::default()),
        )
        .await
        .is_ok();
        server.abort();
        done
    }

    #[tokio::test]
    async fn an_answer_ends_where_its_framing_says() {
        assert!(
            ends(
                &[b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo"],
                false
            )
            .await
        );
        assert!(
            ends(
                &[
                    b"HTTP/1.1 100 Continue\r\n\r\n",
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab",
                    b"c\r\n0\r\nX-T: 1\r\n\r\n"
                ],
                false
            )
            .await
        );
        assert!(ends(&[b"HTTP/1.1 204 No Content\r\n\r\n"], false).await);
        assert!(ends(&[b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"], true).await);
        // Not over: a body still short of its length, a chunked body without its last chunk,
        // and an answer delimited by the close that does not come.
        assert!(
            !ends(
                &[b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nhello"],
                false
            )
            .await
        );
        assert!(
            !ends(
                &[b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"],
                false
            )
            .await
        );
        assert!(!ends(&[b"HTTP/1.1 200 OK\r\n\r\nstream"], false).await);
    }
}
