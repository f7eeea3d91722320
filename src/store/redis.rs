//! The shared store (work in progress).
use super::{Admission, AdmitRequest, BudgetView};
use crate::budget::Limit;
use crate::identity::KeyHash;

pub struct RedisStore;

#[derive(Debug)]
pub struct RedisLease;

impl RedisLease {
    pub async fn release(self) {}
}

impl RedisStore {
    pub fn new(
        _s: &crate::config::StoreSettings,
        _c: crate::store::memory::Clock,
    ) -> std::sync::Arc<Self> {
        std::sync::Arc::new(RedisStore)
    }
    pub async fn admit(&self, _req: &AdmitRequest) -> Admission {
        Admission::Unavailable
    }
    pub async fn refund(&self, _req: &AdmitRequest) {}
    pub async fn peek(&self, _key: &KeyHash, _limit: &Limit) -> Option<BudgetView> {
        None
    }
    pub fn degraded(&self) -> bool {
        false
    }
}
