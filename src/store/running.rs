//! Requests this instance is running, per capped route and key, however they were admitted:
//! what the fallback's local share counts against (DESIGN §4: one instance never runs more
//! than its share, requests Redis admitted that are still running included).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::{lock, short_key, AdmitRequest};

/// What a request counts against while it runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Slot {
    Route(Arc<str>),
    Key(u128),
}

/// Requests this instance runs, per capped route and per capped key, however admitted.
#[derive(Debug, Default)]
pub(crate) struct Running {
    counts: Mutex<HashMap<Slot, u32>>,
    pub(crate) freed: Notify,
}

/// Counts one request in [`Running`] until dropped (it lives in the request's [`Lease`]).
pub(crate) struct RunningGuard {
    running: Arc<Running>,
    slots: Vec<Slot>,
}

impl std::fmt::Debug for RunningGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningGuard")
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut counts = lock(&self.running.counts);
        for s in &self.slots {
            if let Some(n) = counts.get_mut(s) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    counts.remove(s);
                }
            }
        }
        drop(counts);
        self.running.freed.notify_waiters();
    }
}

impl Running {
    /// Counts a request the shared store admitted.
    pub(crate) fn track(self: &Arc<Self>, slots: Vec<Slot>) -> RunningGuard {
        let mut counts = lock(&self.counts);
        for s in &slots {
            *counts.entry(s.clone()).or_default() += 1;
        }
        RunningGuard {
            running: self.clone(),
            slots,
        }
    }

    /// Counts a request only if every slot is below its share; else the first full slot.
    pub(crate) fn try_take(self: &Arc<Self>, wanted: &[(Slot, u32)]) -> Result<RunningGuard, Slot> {
        let mut counts = lock(&self.counts);
        if let Some((full, _)) = wanted
            .iter()
            .find(|(s, share)| counts.get(s).copied().unwrap_or(0) >= *share)
        {
            return Err(full.clone());
        }
        for (s, _) in wanted {
            *counts.entry(s.clone()).or_default() += 1;
        }
        Ok(RunningGuard {
            running: self.clone(),
            slots: wanted.iter().map(|(s, _)| s.clone()).collect(),
        })
    }
}

pub(crate) fn slots_of(req: &AdmitRequest) -> Vec<Slot> {
    let mut slots = vec![];
    if req.route_cap.is_some() {
        slots.push(Slot::Route(req.route.clone()));
    }
    if req.key_cap.is_some() {
        slots.push(Slot::Key(short_key(&req.key)));
    }
    slots
}
