//! The client stream as the front door wraps it: the first byte of each request head, the
//! send-stall timer, the shield that hides a client that went away from Pingora, and a write
//! buffer of one segment, as Pingora's own listener has: a response's head and a small body
//! go out in one system call (and one TCP segment) when Pingora flushes, not one each.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use async_trait::async_trait;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, Ssl, Stream, UniqueID,
    UniqueIDType, ALPN,
};
use tokio::io::{AsyncRead, AsyncWrite, BufWriter, ReadBuf};

use super::ConnState;
use crate::telemetry::{metrics, ClientTimeout};

fn peer_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

/// Pingora's listener's write buffer (`DEFAULT_L4_WRITE_BUFFER_SIZE`: one Ethernet MSS).
const WRITE_BUFFER: usize = 1460;

/// A client stream with the front door's bookkeeping: first-byte time, the send-stall timer
/// and the shield.
pub struct Tracked {
    inner: BufWriter<Stream>,
    conn: Arc<ConnState>,
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The part of the gateway's answer to an unparsable head not yet written (see
    /// [`Tracked::refuse_head`]).
    refusal: Option<bytes::Bytes>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Tracked {
    pub fn new(inner: Stream, conn: Arc<ConnState>) -> Tracked {
        Tracked {
            inner: BufWriter::with_capacity(WRITE_BUFFER, inner),
            conn,
            stall: None,
            refusal: None,
        }
    }

    pub fn conn(&self) -> &Arc<ConnState> {
        &self.conn
    }

    /// A write that makes no progress for `send_timeout` fails with `TimedOut`.
    fn poll_stall<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.conn.send_timeout();
        if timeout.is_zero() {
            return Poll::Pending;
        }
        let sleep = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.stall = None;
                if !self.conn.send_timed_out.swap(true, Ordering::SeqCst) {
                    metrics().client_timeout(ClientTimeout::Send);
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "client did not read within send_timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// The result of a write (or flush, or shutdown) of `len` bytes, through the shield.
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
        ok: impl FnOnce() -> T,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(Err(e)) if self.conn.shielded() && peer_gone(&e) => {
                self.conn.gone.store(true, Ordering::SeqCst);
                self.stall = None;
                Poll::Ready(Ok(ok()))
            }
            Poll::Ready(r) => {
                self.stall = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.poll_stall(cx),
        }
    }

    /// Pingora answers a head it cannot parse with an empty 400 of its own, before any hook
    /// (so the gateway never sees the request). Its bytes are replaced, write for write, by
    /// the gateway's answer: a problem JSON, the connection closed (`ok`: what the caller
    /// wrote, reported as written).
    fn refuse_head(&mut self, cx: &mut Context<'_>, ok: usize) -> Poll<io::Result<usize>> {
        if !self.conn.refused_head.swap(true, Ordering::SeqCst) {
            self.refusal = Some(crate::proxy::malformed_head_answer());
        }
        while let Some(rest) = self.refusal.as_mut().filter(|r| !r.is_empty()) {
            match Pin::new(&mut self.inner).poll_write(cx, rest) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => bytes::Buf::advance(rest, n),
                r @ (Poll::Ready(Err(_)) | Poll::Pending) => return self.written(cx, r, || ok),
            }
        }
        self.refusal = None;
        Poll::Ready(Ok(ok))
    }

    fn discarding(&self) -> bool {
        self.conn.shielded() && self.conn.client_gone()
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.discarding() {
            return Poll::Pending;
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if n == 0 && this.conn.shielded() {
                    // The client closed its side: pend, so the proxy loop keeps reading the
                    // upstream (it is woken by the upstream side, not by this stream). A FIN
                    // may be a half-close from a client still reading: not gone until a write
                    // fails.
                    return Poll::Pending;
                }
                if n > 0 {
                    this.conn.read_bytes(n);
                }
                if n > 0
                    && !this.conn.head_complete()
                    && this.conn.first_byte_us.load(Ordering::Relaxed) == 0
                {
                    this.conn
                        .first_byte_us
                        .store(this.conn.now_us(), Ordering::SeqCst);
                    this.conn.first_byte.notify_waiters();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) if this.conn.shielded() && peer_gone(&e) => {
                this.conn.gone.store(true, Ordering::SeqCst);
                Poll::Pending
            }
            other => other,
        }
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.discarding() {
            return Poll::Ready(Ok(buf.len()));
        }
        if this.conn.refusing_head() {
            return this.refuse_head(cx, buf.len());
        }
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        let len = buf.len();
        this.written(cx, r, || len)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if this.discarding() {
            return Poll::Ready(Ok(len));
        }
        if this.conn.refusing_head() {
            return this.refuse_head(cx, len);
        }
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.written(cx, r, || len)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.discarding() {
            return Poll::Ready(Ok(()));
        }
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.written(cx, r, || ())
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.discarding() {
            return Poll::Ready(Ok(()));
        }
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.written(cx, r, || ())
    }
}

impl Drop for Tracked {
    /// A connection closed with part of an answer still in the write buffer: the upstream
    /// broke off a fixed-length answer whose head and body so far had not filled it (Pingora
    /// flushes such an answer only at its end, and after an upstream error drops the
    /// connection unflushed). What is buffered is written now, as far as the socket takes it
    /// without waiting: the client gets the head and the part of the body that came, short of
    /// the length it was told, as a chunked answer's client does, instead of an empty reply it
    /// might take for a request never sent.
    ///
    /// Through the buffer's own flush, which goes on from where an earlier one stopped (a
    /// partial write leaves the bytes already sent in the buffer, marked as written).
    fn drop(&mut self) {
        if self.inner.buffer().is_empty() || self.discarding() {
            return;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let _ = Pin::new(&mut self.inner).poll_flush(&mut cx);
    }
}

#[async_trait]
impl Shutdown for Tracked {
    async fn shutdown(&mut self) {
        // What is buffered goes first; a client that is gone cannot take it anyway.
        let _ = tokio::io::AsyncWriteExt::flush(self).await;
        Shutdown::shutdown(&mut **self.inner.get_mut()).await
    }
}

impl UniqueID for Tracked {
    fn id(&self) -> UniqueIDType {
        self.inner.get_ref().id()
    }
}

impl Ssl for Tracked {
    fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
        self.inner.get_ref().get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ref().get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.get_ref().selected_alpn_proto()
    }
}

impl GetTimingDigest for Tracked {
    fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
        self.inner.get_ref().get_timing_digest()
    }
}

impl GetProxyDigest for Tracked {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        self.inner.get_ref().get_proxy_digest()
    }
}

impl GetSocketDigest for Tracked {
    fn get_socket_digest(&self) -> Option<Arc<pingora::protocols::SocketDigest>> {
        self.inner.get_ref().get_socket_digest()
    }
}

#[async_trait]
impl Peek for Tracked {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.get_mut().try_peek(buf).await
    }
}
