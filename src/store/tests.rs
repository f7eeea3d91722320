//! The store's own types.

use super::*;

fn size_of_future<F: std::future::Future>(_: &F) -> usize {
    std::mem::size_of::<F>()
}

/// Every request phase's future embeds the store's; Pingora boxes (copies) those futures
/// per request, so the shared store's large ones must stay behind a pointer.
#[test]
fn store_futures_stay_small() {
    let store = Store::Memory(MemoryStore::new(memory::Clock::new(0)));
    let req = AdmitRequest {
        key: [0; 32],
        limit: Limit::new(10, Duration::from_secs(1), Duration::ZERO).unwrap(),
        also: vec![],
        cost: 1,
        key_cap: None,
        route: Arc::from("/"),
        route_cap: None,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    };
    let bound = 512;
    assert!(size_of_future(&store.decide(&req)) <= bound);
    assert!(size_of_future(&store.refund(&req, Charge::None)) <= bound);
    assert!(size_of_future(&Lease::default().release()) <= bound);
}
