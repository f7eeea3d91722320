//! tollgate: an API gateway on Pingora that charges every request a per-route cost against a
//! per-key budget shared by the whole fleet (Redis), and caps expensive routes' concurrency.
//!
//! Where things are decided:
//! - [`config`]: gateway.yaml → validated [`config::Config`];
//! - [`route`]: path normalization and the endpoint table (what a request costs);
//! - [`identity`]: which API key pays (hashed at once);
//! - [`decision`]: **where the cost is decided** — classify, identify, judge the store's answer;
//! - [`budget`]: the GCRA arithmetic (whether it fits); [`policy`]: a budget as applied;
//! - [`store`]: where budgets and in-flight slots live (memory or Redis);
//! - [`admission`]: an admitted request's [`admission::Ticket`] — where a slot is released
//!   and a charge refunded or settled;
//! - [`proxy`]: the Pingora phases, translated to and from `decision`; [`problem`]: what a
//!   refused client reads;
//! - [`admin`], [`telemetry`]: what an SRE sees; [`audit`]: are the costs true (DESIGN §6);
//!   [`state`]: what a running gateway shares; [`shutdown`]: the drain; [`app`]: process
//!   assembly and signals; [`front`]: client connections; [`tls`]: TLS termination's
//!   certificate; [`upstreams`]: named upstreams and pools; [`trace`]: OpenTelemetry spans.

pub mod accept;
pub mod admin;
pub mod admission;
pub mod app;
pub mod audit;
pub mod background;
pub mod budget;
pub mod cli;
pub mod config;
pub mod decision;
pub mod front;
pub mod hold;
pub mod identity;
pub mod jobs;
pub mod pid_file;
pub mod policy;
pub mod problem;
pub mod proxy;
pub mod reason;
pub mod route;
pub mod sample_api;
pub mod shutdown;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod upstreams;

/// This machine's wall clock in ms since the Unix epoch (0 before it): for what is only
/// compared with other instances' clocks loosely (budgets run on Redis's clock).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
