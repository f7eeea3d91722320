//! What a job was charged, kept in its record (`chg`): its cost and every budget of its charge
//! with that budget's limit. Its refund (cancelled, expired, unreachable upstream) and its
//! settling (`cost_from_response`, `cost_per_second`) then give back and settle what was
//! charged at its submission, whatever a reload changed since — the route's cost, the key's
//! plan, the route's shared budget, or the route itself — as a synchronous request's ticket
//! keeps its charge (and the memory store's job its ticket).

use serde::{Deserialize, Serialize};

use super::record::{field, Record};
use crate::budget::Limit;
use crate::decision;
use crate::identity::Identity;
use crate::route::Route;
use crate::store::{AdmitRequest, Bucket, Extra};

/// A budget's limit: per_unit, rate, capacity, max_delay.
type Figures = (u64, u64, u64, u64);

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Charged {
    /// The cost charged.
    c: u64,
    /// The key's first budget.
    l: Figures,
    /// Each further budget: `k` (another of the key's plan) or `r` (a route's shared), its
    /// name, its limit.
    x: Vec<(char, String, Figures)>,
}

fn figures(l: &Limit) -> Figures {
    (l.per_unit, l.rate, l.capacity, l.max_delay)
}

fn limit((per_unit, rate, capacity, max_delay): Figures) -> Limit {
    Limit {
        per_unit,
        rate,
        capacity,
        max_delay,
    }
}

/// The record's `chg` of a job charged as `admit`.
pub(super) fn of(admit: &AdmitRequest) -> Vec<u8> {
    let charged = Charged {
        c: admit.cost,
        l: figures(&admit.limit),
        x: admit
            .also
            .iter()
            .map(|e| match &e.bucket {
                Bucket::Key(n) => ('k', n.to_string(), figures(&e.limit)),
                Bucket::Route(n) => ('r', n.to_string(), figures(&e.limit)),
            })
            .collect(),
    };
    serde_json::to_vec(&charged).unwrap_or_default()
}

/// The cost the job of record `r` was charged, if the record keeps it.
pub(super) fn cost_of(r: &Record) -> Option<u64> {
    serde_json::from_slice::<Charged>(field(r, "chg"))
        .ok()
        .map(|c| c.c)
}

/// The charge of the job of record `r`, paid by `who`, as the store is asked to give it back
/// or settle it (never a key slot: a job's is its own, `job_release`): as it was charged when
/// the record keeps it, else (a record of an older instance) as `route` charges now, if the
/// route is still there.
pub(super) fn admit_of(r: &Record, route: Option<&Route>, who: &Identity) -> Option<AdmitRequest> {
    let now = route.map(|route| AdmitRequest {
        key_cap: None,
        ..decision::admit_request(route, who)
    });
    let Ok(charged) = serde_json::from_slice::<Charged>(field(r, "chg")) else {
        return now;
    };
    let label = super::record::text(r, "route");
    let base = now.unwrap_or_else(|| AdmitRequest {
        key: who.hash,
        limit: limit(charged.l),
        also: vec![],
        cost: charged.c,
        key_cap: None,
        route: label.into(),
        route_cap: None,
        queue_timeout: std::time::Duration::ZERO,
        fair: Default::default(),
    });
    let also = charged
        .x
        .into_iter()
        .map(|(kind, name, l)| Extra {
            bucket: match kind {
                'r' => Bucket::Route(name.into()),
                _ => Bucket::Key(name.into()),
            },
            limit: limit(l),
        })
        .collect();
    Some(AdmitRequest {
        limit: limit(charged.l),
        also,
        cost: charged.c,
        ..base
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_charge_reads_back_as_it_was_made_without_its_route() {
        let l = |n| Limit::new(n, Duration::from_secs(60), Duration::ZERO).unwrap();
        let who = Identity {
            hash: [7; 32],
            id: None,
            policy: crate::policy::minute_and_day(10, 100).into(),
        };
        let admit = AdmitRequest {
            key: who.hash,
            limit: l(10),
            also: vec![
                Extra {
                    bucket: Bucket::Key("day".into()),
                    limit: l(100),
                },
                Extra {
                    bucket: Bucket::Route("/p".into()),
                    limit: l(3),
                },
            ],
            cost: 5,
            key_cap: Some(2),
            route: "/p".into(),
            route_cap: Some(1),
            queue_timeout: Duration::from_secs(1),
            fair: Default::default(),
        };
        let r: Record = [
            ("chg".to_string(), of(&admit)),
            ("route".to_string(), b"/p".to_vec()),
        ]
        .into_iter()
        .collect();
        assert_eq!(cost_of(&r), Some(5));
        let back = admit_of(&r, None, &who).unwrap();
        assert_eq!(back.cost, 5);
        assert_eq!(back.limit, admit.limit);
        assert_eq!(back.also, admit.also);
        assert_eq!(&*back.route, "/p");
        assert_eq!(back.key_cap, None);
        // Without its charge kept and without its route: nothing to give back by.
        assert!(admit_of(&Record::new(), None, &who).is_none());
    }
}
