//! A request's hold on what it was admitted to: the slots it takes (in whichever store took
//! them) and where its units were charged, so that a release frees the same slots and a refund
//! goes back to the same place.

use super::{fair, fallback, memory, redis, running};
use crate::budget::Limit;

/// Held while a request is in flight; frees its slots when released or dropped. It also
/// records where the request was charged, so that a refund goes back to the same place.
#[derive(Debug, Default)]
pub struct Lease {
    slots: Slots,
    charge: Charge,
    /// Counts the request among those this instance runs on its route and key (for the
    /// fallback's local share) until the lease goes.
    running: Option<running::RunningGuard>,
    fallback: bool,
    /// A local admission's registration in the shared store once it answers again.
    adopted: Option<fallback::adopt::Adoptable>,
}

/// Where an admitted request's units were taken from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Charge {
    /// Nowhere (`on_error: allow` past the local count).
    #[default]
    None,
    /// This process's memory, under this limit (the memory store, or the Redis store's
    /// `on_error: local` share).
    Local(Limit),
    /// The shared Redis budget.
    Shared,
    /// The shared Redis budget, from this instance's budget slice held there under this id
    /// (`store.slices`): a refund goes back into the slice, or to the hold in Redis.
    Slice(u128),
}

/// The slots a lease holds, in whichever store took them.
#[derive(Debug, Default)]
enum Slots {
    #[default]
    None,
    Memory(memory::MemoryLease),
    Redis(redis::RedisLease),
}

impl Lease {
    /// Charged in this process under `limit`, holding `slots`.
    pub(crate) fn local(slots: memory::MemoryLease, limit: Limit) -> Lease {
        Lease {
            slots: Slots::Memory(slots),
            charge: Charge::Local(limit),
            ..Lease::default()
        }
    }

    /// Adds the route slot a memory-store request got after it was charged (it queued).
    pub(crate) fn attach_route(&mut self, slot: fair::RouteSlot) {
        if let Slots::Memory(m) = &mut self.slots {
            m.attach_route(slot);
        }
    }

    /// Charged in the shared store, holding `slots` there (if the request took any).
    pub(crate) fn shared(slots: Option<redis::RedisLease>) -> Lease {
        Lease {
            slots: slots.map_or(Slots::None, Slots::Redis),
            charge: Charge::Shared,
            ..Lease::default()
        }
    }

    /// Spent from this instance's budget slice `hold` (charged in the shared store).
    pub(crate) fn sliced(hold: u128) -> Lease {
        Lease {
            charge: Charge::Slice(hold),
            ..Lease::default()
        }
    }

    pub(super) fn adopt_with(&mut self, adoptable: Option<fallback::adopt::Adoptable>) {
        self.adopted = adoptable;
    }

    pub(super) fn counted(
        mut self,
        running: Option<running::RunningGuard>,
        fallback: bool,
    ) -> Lease {
        self.running = running;
        self.fallback = fallback;
        self
    }

    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// True when `store.on_error` admitted the request (the shared store was unreachable).
    pub fn fallback(&self) -> bool {
        self.fallback
    }

    /// Frees the slots now (the drop guard does the same, later and without waiting).
    pub async fn release(self) {
        match self.slots {
            Slots::None => {}
            Slots::Memory(l) => drop(l),
            // Boxed for the reason given in `Store::decide`.
            Slots::Redis(l) => Box::pin(l.release()).await,
        }
        drop(self.running);
    }
}
