//! A TCP proxy that can blackhole a connection and heal it: a network partition on demand.

use super::process::BackgroundRuntime;

/// A TCP proxy in front of a Redis (or anything): it can blackhole its connections — holding
/// what is sent both ways, which the kernel buffers — and heal them, delivering it all late.
/// One gateway's path to Redis, cut and restored while the others' stays up.
pub struct Proxy {
    pub port: u16,
    open: tokio::sync::watch::Sender<bool>,
    _rt: BackgroundRuntime,
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        let rt = BackgroundRuntime::new(1);
        let (open, watch) = tokio::sync::watch::channel(true);
        let port = rt.serve(move |listener| async move {
            while let Ok((client, _)) = listener.accept().await {
                let watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pump(cr, sw, watch.clone()), pump(sr, cw, watch));
                });
            }
        });
        Proxy {
            port,
            open,
            _rt: rt,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Nothing passes any more (new connections are accepted, then hang the same way).
    pub fn blackhole(&self) {
        self.open.send_replace(false);
    }

    /// Everything held is delivered, and traffic flows again.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }
}

/// Copies `from` to `to`, holding each chunk while the proxy is blackholed.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if open.wait_for(|o| *o).await.is_err() {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
