//! Work that runs beside Pingora's request runtimes: a named thread with a current-thread
//! tokio runtime of its own (the admin listener, upstream health checks, the store's start-up
//! probe).

use std::future::Future;

/// Runs `work` on a new thread called `name`, on a runtime of its own. `Err` if the thread
/// cannot be started; a runtime that cannot be built is logged and the work not done.
pub fn spawn<F, Fut>(name: String, work: F) -> std::io::Result<()>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(work()),
                Err(e) => tracing::error!(
                    thread = std::thread::current().name().unwrap_or_default(),
                    error = %e,
                    "cannot build a runtime for background work"
                ),
            }
        })
        .map(drop)
}
