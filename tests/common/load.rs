//! Load on a fleet while something goes wrong underneath: clients that keep sending one key's
//! requests across the gateways until told to stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::client::get;
use super::gateway::{metric, Gateway};

/// `workers` clients sending `GET`s as `key` one after another, each of which must be 200.
/// Worker `i`'s requests are numbered from `i + 1`: request `n` asks for `path(n)` on gateway
/// `n % gws.len()`, then waits `pause` (none when zero).
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(
        c: &reqwest::Client,
        gws: &Arc<Vec<Gateway>>,
        key: &'static str,
        workers: usize,
        pause: Duration,
        path: fn(usize) -> &'static str,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|i| {
                let (c, gws, stop) = (c.clone(), gws.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = i;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let path = path(n);
                        let r = get(&c, gws[n % gws.len()].url(path), key).await;
                        assert_eq!(r.status(), 200, "{path}");
                        if !pause.is_zero() {
                            tokio::time::sleep(pause).await;
                        }
                    }
                })
            })
            .collect();
        Load { stop, tasks }
    }

    /// Stops the clients and waits for each one's last request.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
    }
}

/// A metric series summed over the gateways of a fleet (each must expose it).
pub async fn fleet_metric(gws: &[Gateway], series: &str) -> f64 {
    let mut sum = 0.0;
    for gw in gws {
        sum += metric(gw, series).await;
    }
    sum
}
