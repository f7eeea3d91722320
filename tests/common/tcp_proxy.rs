//! A TCP proxy that can blackhole a connection and heal it: a network partition on demand;
//! or one that delivers everything a fixed time late: a Redis that is a network away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::process::BackgroundRuntime;

/// A TCP proxy in front of a Redis (or anything): it can blackhole its connections — holding
/// what is sent both ways, which the kernel buffers — and heal them, delivering it all late.
/// One gateway's path to Redis, cut and restored while the others' stays up.
pub struct Proxy {
    pub port: u16,
    open: Arc<tokio::sync::watch::Sender<Pass>>,
    /// Chunks that were held, then let through.
    late: Arc<AtomicUsize>,
    /// Chunks found held (let through since or not).
    held: Arc<AtomicUsize>,
    /// Chunks read from clients (on their way to the target).
    from_clients: Arc<AtomicUsize>,
    _rt: BackgroundRuntime,
}

/// What the proxy lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pass {
    All,
    Nothing,
    /// Everything but a chunk that contains these bytes (and what follows it on its
    /// connection, which must come after it).
    AllBut(Vec<u8>),
    /// Everything; but the next chunk from a client that contains these bytes is dropped and
    /// its connection cut (then `All` again).
    DropOnce(Vec<u8>),
}

impl Pass {
    fn lets(&self, chunk: &[u8]) -> bool {
        match self {
            Pass::All => true,
            Pass::Nothing => false,
            Pass::AllBut(needle) => !contains(chunk, needle),
            Pass::DropOnce(_) => true,
        }
    }

    fn drops(&self, chunk: &[u8]) -> bool {
        matches!(self, Pass::DropOnce(needle) if contains(chunk, needle))
    }
}

fn contains(chunk: &[u8], needle: &[u8]) -> bool {
    chunk.windows(needle.len()).any(|w| w == needle)
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        Proxy::start_delayed(target, Duration::ZERO)
    }

    /// A proxy that delivers each chunk, both ways, `delay` after it was read: in order, and
    /// pipelined (a chunk read while an earlier one is on its way is not held behind that
    /// one's delay). A round trip through it takes at least twice `delay`. What it blackholes
    /// or holds is held as it is read: chunks already on their way are still delivered.
    pub fn start_delayed(target: u16, delay: Duration) -> Proxy {
        let rt = BackgroundRuntime::new(1);
        let (open, watch) = tokio::sync::watch::channel(Pass::All);
        let open = Arc::new(open);
        let opener = open.clone();
        let late = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(AtomicUsize::new(0));
        let from_clients = Arc::new(AtomicUsize::new(0));
        let (counted, reads, holding) = (late.clone(), from_clients.clone(), held.clone());
        let port = rt.serve(move |listener| async move {
            while let Ok((client, _)) = listener.accept().await {
                let (watch, late, reads) = (watch.clone(), counted.clone(), reads.clone());
                let holding = holding.clone();
                let opener = opener.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        pump(
                            cr,
                            sw,
                            watch.clone(),
                            late.clone(),
                            delay,
                            Some(FromClient {
                                reads,
                                opener,
                                held: holding,
                            })
                        ),
                        pump(sr, cw, watch, late, delay, None)
                    );
                });
            }
        });
        Proxy {
            port,
            open,
            late,
            held,
            from_clients,
            _rt: rt,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Nothing passes any more (new connections are accepted, then hang the same way).
    pub fn blackhole(&self) {
        self.open.send_replace(Pass::Nothing);
    }

    /// What is sent with `needle` in it is held (on its connection, with all that follows it
    /// there); everything else passes: one kind of call delivered late.
    pub fn hold_matching(&self, needle: &str) {
        self.open
            .send_replace(Pass::AllBut(needle.as_bytes().to_vec()));
    }

    /// The next command a client sends with `needle` in it never reaches the target: it is
    /// dropped and its connection cut (the client sees the connection close under it).
    /// Everything else passes.
    pub fn drop_next_matching(&self, needle: &str) {
        self.open
            .send_replace(Pass::DropOnce(needle.as_bytes().to_vec()));
    }

    /// How many chunks it has read from its clients so far (each on its way to the target
    /// once read: a command has left its client).
    pub fn read_from_clients(&self) -> usize {
        self.from_clients.load(Ordering::SeqCst)
    }

    /// How many chunks were held, then let through (delivered, or on their way).
    pub fn delivered_late(&self) -> usize {
        self.late.load(Ordering::SeqCst)
    }

    /// How many chunks from clients were found held so far (delivered since or not).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Everything held is delivered, and traffic flows again.
    pub fn heal(&self) {
        self.open.send_replace(Pass::All);
    }
}

/// What a pump from a client counts, and the proxy's switch it may flip.
struct FromClient {
    /// Chunks read.
    reads: Arc<AtomicUsize>,
    opener: Arc<tokio::sync::watch::Sender<Pass>>,
    /// Chunks found held.
    held: Arc<AtomicUsize>,
}

/// Copies `from` to `to`, holding each chunk the proxy does not let through until it does,
/// and delivering each `delay` after it was read (at once when `delay` is zero); from a client
/// (`client`: where it counts the chunks it reads, the proxy's switch, and where it counts those
/// it holds), drops the chunk
/// `Pass::DropOnce` names and cuts the connection.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: tokio::sync::watch::Receiver<Pass>,
    late: Arc<AtomicUsize>,
    delay: Duration,
    client: Option<FromClient>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Read and let through in order; written by the writer below when due, so a chunk read
    // while an earlier one waits out its delay is not held behind it.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if let Some(FromClient { reads, opener, .. }) = &client {
                reads.fetch_add(1, Ordering::SeqCst);
                if open.borrow().drops(&buf[..n]) {
                    opener.send_replace(Pass::All);
                    break;
                }
            }
            let held = !open.borrow().lets(&buf[..n]);
            if let (true, Some(c)) = (held, &client) {
                c.held.fetch_add(1, Ordering::SeqCst);
            }
            if open.wait_for(|p| p.lets(&buf[..n])).await.is_err() {
                break;
            }
            if held {
                late.fetch_add(1, Ordering::SeqCst);
            }
            let due = tokio::time::Instant::now() + delay;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            if !delay.is_zero() {
                tokio::time::sleep_until(due).await;
            }
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
