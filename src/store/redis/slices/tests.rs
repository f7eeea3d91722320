use super::*;
use std::sync::Arc;

mod charging;
mod model;
mod sizing;

use model::Model;

fn limit(max_cost: u64, window: Duration) -> Limit {
    Limit::new(max_cost, window, Duration::ZERO).unwrap()
}

fn req(limit: Limit, cost: u64) -> AdmitRequest {
    AdmitRequest {
        key: [7; 32],
        limit,
        also: vec![],
        cost,
        key_cap: None,
        route: Arc::from("r"),
        route_cap: None,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

/// Redis's answer granting what `ask` asked for, at Redis time `now_us`.
fn grant(ask: Ask, now_us: u64) -> Seen {
    Seen {
        granted: ask.slice,
        now_us,
        ..Seen::default()
    }
}

fn place() -> Place {
    Place {
        holds: "t{x}h".into(),
        budgets: vec![("t{x}b".into(), limit(1, Duration::from_secs(1)))],
    }
}
