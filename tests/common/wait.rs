//! Waiting for what happens in the background (a log line written, a metric moved, Redis
//! updated): poll until it has happened, fail with what was seen if it does not in time.

use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it gives a value; panics with its last `Err` once
/// `within` has passed.
pub async fn eventually<T>(
    within: Duration,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        match check().await {
            Ok(v) => return v,
            Err(seen) => assert!(start.elapsed() < within, "after {within:?}: {seen}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
