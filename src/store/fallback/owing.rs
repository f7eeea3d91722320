//! What the fallback admitted, on its way to the shared store: sent before the key's next
//! shared decision, and by a background task while nothing asks.

use std::sync::Arc;

use super::{FallbackStore, SharedStore, SENDING_WAIT, WRITE_BACK_EVERY};
use crate::store::write_back::Owed;
use crate::store::{AdmitRequest, StoreError};

impl<S: SharedStore> FallbackStore<S> {
    /// What the fallback admitted for this key is charged before the shared store decides
    /// on it again, so that its decision sees the debt; one the write-back task is sending
    /// is waited for (it would be overtaken). A debt that could not be sent leaves this
    /// decision to the fallback.
    pub(super) async fn charge_owed_first(&self, req: &AdmitRequest) -> Result<(), StoreError> {
        if !self.owed.owes(req) {
            return Ok(());
        }
        let _in_hand = self.owed.in_hand(req);
        let mut owed = self.owed.take(req);
        if owed.is_empty() {
            self.owed.sending_done(req, SENDING_WAIT).await;
            owed = self.owed.take(req);
        }
        let mut res = Ok(());
        for o in owed {
            if res.is_ok() {
                res = self.send_owed(o).await;
            } else {
                self.owed.put_back([o]);
            }
        }
        res
    }

    /// Sends one key's debt under an id of its own; on an error it is owed again. One that
    /// may have run (a timeout, a connection that broke: after a restart, every thread's old
    /// connection does) is sent again as it was, and the store charges its id once.
    async fn send_owed(&self, mut o: Owed) -> Result<(), StoreError> {
        let fresh = o.id == 0;
        if fresh {
            o.id = rand::random::<u64>() | 1;
        }
        let sent = self
            .shared
            .write_back(&o.key, &o.limit, &o.also, o.units, o.id, true)
            .await;
        if let Err(e) = &sent {
            tracing::debug!(error = %e, units = o.units, "a write-back did not reach the store: sent again");
            if fresh && !e.may_have_run() {
                // Surely not run, and never sent before: owed like any other units
                // (merged, forgivable). Once sent under an id that may have run, the units
                // keep that id however the later sends fail: an earlier one may still land.
                o.id = 0;
            }
            self.owed.put_back([o]);
        }
        sent
    }

    /// Sends what is owed until nothing is; the store's breaker paces the attempts.
    pub(super) async fn write_back_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(WRITE_BACK_EVERY).await;
            let mut all = self.owed.take_all().into_iter();
            while let Some(o) = all.next() {
                let sent = o.clone();
                match self.send_owed(o).await {
                    Ok(()) => self.owed.done_sending(&sent),
                    // Sent again next time; the others may go now.
                    Err(e) if e.may_have_run() => {}
                    Err(_) => {
                        self.owed.put_back(all);
                        break;
                    }
                }
            }
            if self.owed.done_if_empty() {
                return;
            }
        }
    }

    /// Adds to what `req.key` owes the shared budget, starting the sender if none runs.
    pub(super) fn owe(self: &Arc<Self>, req: &AdmitRequest, units: u64) {
        if self.owed.add(req, units) {
            tokio::spawn(self.clone().write_back_loop());
        }
    }
}
