//! Where a request's state lives in Redis: the key layout.
//!
//! Every key is `t` (tollgate's prefix), a hash tag `{…}`, and a type letter:
//!
//! | key             | holds                                               |
//! |-----------------|-----------------------------------------------------|
//! | `t{<key tag>}b` | an API key's budget (`level:at_us:rate:per_unit`)   |
//! | `t{<key tag>}b:<name>` | another budget of the key's plan, by name (`budgets:`) |
//! | `t{<key tag>}f` | the API key's in-flight leases (sorted set, expiry) |
//! | `t{<key tag>}h` | the API key's budget slices held by instances (hash: hold id → `units:expiry_us`) |
//! | `t{<key tag>}a<id>` | admission `id` of the key: `1` charged, `u` undone (expires) |
//! | `t{<key tag>}a<id>:r` | admission `id`'s charge refunded, once (it left the queue unserved; expires) |
//! | `t:r{<tag>}f`   | a route's in-flight leases (tag of the route label) |
//! | `t:r{<tag>}b`   | a route's `shared` budget (tag of the route label)  |
//! | `t:r{<tag>}q`, `…k`, `…s`, `…x` | a capped route's fair queue: waiters, keys to serve, state, ids given up (`lua/queue.lua`) |
//! | `t:j:<id>`      | an async job's record (hash; `store/lua/jobs.lua`)   |
//!
//! The tag is 60 bits of a SHA-256 (of the API key, never the key itself; of the route label
//! for a route) in 10 URL-safe base64 characters. Redis Cluster hashes only what is inside the
//! braces, so one API key's budget and lease set share a slot — a script that touches both
//! never fails with CROSSSLOT. A route's lease set is shared by every key, so it has a slot of
//! its own: on Redis Cluster a capped request is decided in two calls, the key's slot first,
//! then the route's (see `RedisBackend::run_admit`); anything else shared by all callers of a
//! route belongs with the route's tag, in that second call. The script tells a key's own
//! budgets (`t{`, where slices are held) from a route's (`t:r{`) by that prefix. A budget key
//! is 14 characters: that is what keeps a budget at 104 bytes of Redis memory (`MEMORY
//! USAGE`; 88 while its value is at most 28 characters).
//!
//! The few functions that are `pub` are for reading Redis from outside the gateway — the
//! integration tests look at budgets, holds, lease sets and job records by these names —
//! so that the layout is written down once, here.

use crate::identity::KeyHash;

/// 60 bits of a SHA-256 in 10 URL-safe base64 characters, made on the stack: every `admit`
/// names three or four keys by it.
struct Tag([u8; 12]);

impl Tag {
    fn of(hash: &KeyHash) -> Tag {
        use base64::Engine;
        let mut buf = [0u8; 12];
        // 8 bytes are 11 characters without padding.
        let n = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode_slice(&hash[..8], &mut buf)
            .unwrap_or(0);
        debug_assert_eq!(n, 11);
        Tag(buf)
    }

    fn as_str(&self) -> &str {
        // URL-safe base64 is ASCII.
        std::str::from_utf8(&self.0[..10]).unwrap_or_default()
    }

    /// `t{<tag>}<kind><id>`: a key of the API key's slot.
    fn key(&self, kind: &str, id: &str) -> String {
        let mut s = String::with_capacity(13 + kind.len() + id.len());
        s.push_str("t{");
        s.push_str(self.as_str());
        s.push('}');
        s.push_str(kind);
        s.push_str(id);
        s
    }
}

fn tag(hash: &KeyHash) -> String {
    Tag::of(hash).as_str().to_owned()
}

/// The key's tag, as a route's queue names the key (`lua/queue.lua`).
pub fn key_tag(key: &KeyHash) -> String {
    tag(key)
}

/// The 56 bits of the key's hash that its tag spells in full (the first 9⅓ of its 10
/// characters): what names an API key in a message about its `t{<tag>}…` keys.
pub(super) fn tag_bits(key: &KeyHash) -> u64 {
    let mut b = [0u8; 8];
    b[..7].copy_from_slice(&key[..7]);
    u64::from_le_bytes(b)
}

/// [`tag_bits`] of the key a `t{<tag>}…` key's tag names (as `lua/store/extra.lua`'s
/// `gave_back` publishes it); `None` for anything else.
pub(super) fn tag_bits_of(tag: &str) -> Option<u64> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    use base64::Engine;
    // The tag ends inside the hash's eighth byte: its last 4 bits are left over.
    const TAG: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::URL_SAFE,
        GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(DecodePaddingMode::RequireNone),
    );
    if tag.len() != 10 {
        return None;
    }
    let mut b = [0u8; 9];
    match TAG.decode_slice(tag, &mut b) {
        Ok(7) => {
            b[7] = 0;
            Some(u64::from_le_bytes(b[..8].try_into().ok()?))
        }
        _ => None,
    }
}

/// An API key's budget (its plan's first, or only, one).
pub fn budget_key(key: &KeyHash) -> String {
    Tag::of(key).key("b", "")
}

/// A further budget of the key's plan (`budgets:`), by name: the budget key's hash tag, so
/// that one script charges all of a key's budgets on one node.
pub(super) fn named_budget_key(key: &KeyHash, name: &str) -> String {
    format!("{}:{name}", budget_key(key))
}

/// A route's `shared` budget: the route label's hash tag (its own slot in a Cluster).
pub(super) fn shared_budget_key(route: &str) -> String {
    format!(
        "t:r{{{}}}b",
        tag(&crate::identity::hash_key(route.as_bytes()))
    )
}

/// The budget slices instances hold of the key (`super::slices`), in its budgets' slot.
pub fn holds_key(key: &KeyHash) -> String {
    Tag::of(key).key("h", "")
}

/// The key's budget and its holds, from one hash of the key (what every `admit` names).
pub(super) fn budget_and_holds_keys(key: &KeyHash) -> (String, String) {
    let tag = Tag::of(key);
    (tag.key("b", ""), tag.key("h", ""))
}

/// The record of admission `id` of the key (the admission ids of `lua/store/common.lua`), in its slot.
pub(super) fn admission_key(key: &KeyHash, id: &str) -> String {
    Tag::of(key).key("a", id)
}

/// Marks the refund of admission `id`'s charge as made (`lua/store/refund.lua`), so that it
/// is made once however often it is sent; in the key's slot, as its budgets.
pub(super) fn refund_marker(key: &KeyHash, id: &str) -> String {
    format!("{}:r", admission_key(key, id))
}

pub(super) fn key_slots_key(key: &KeyHash) -> String {
    Tag::of(key).key("f", "")
}

/// A route's in-flight leases (`route` is the route's label), in a slot of its own.
pub fn route_slots_key(route: &str) -> String {
    format!(
        "t:r{{{}}}f",
        tag(&crate::identity::hash_key(route.as_bytes()))
    )
}

/// The keys of a route's fair queue, in `lua/queue.lua`'s KEYS order.
pub(super) type QueueKeys = [String; 6];

/// The keys of a route's fair queue (`lua/queue.lua`'s KEYS), from its lease set
/// (`t:r{tag}f`): the lease set, the waiters (`q`), the keys to serve (`k`), the state (`s`),
/// the ids given up (`x`) and the charges owed (`o`). `None` for a key's own lease set
/// (`t{tag}f`).
pub(super) fn queue_keys(lease_set: &str) -> Option<QueueKeys> {
    let base = lease_set
        .strip_suffix('f')
        .filter(|b| b.starts_with("t:r{"))?;
    Some([
        lease_set.to_string(),
        format!("{base}q"),
        format!("{base}k"),
        format!("{base}s"),
        format!("{base}x"),
        format!("{base}o"),
    ])
}

/// A capped route's queue state (`lua/queue.lua`'s KEYS[4]: who runs, who waits, which
/// instance beats), in the route's slot.
pub fn route_queue_state_key(route: &str) -> String {
    let [_, _, _, state, _, _] = queue_keys(&route_slots_key(route)).expect("a route's lease set");
    state
}

/// An async job's record (`super::jobs`), by the job's id. No hash tag: `lua/jobs.lua` names
/// no other key.
pub fn job_key(id: &str) -> String {
    format!("t:j:{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_a_hash_tag_and_no_raw_key() {
        let h = crate::identity::hash_key(b"secret-key");
        let k = budget_key(&h);
        assert!(k.starts_with("t{") && k.ends_with("}b"), "{k}");
        assert_eq!(k.len(), 14);
        assert!(!k.contains("secret"));
        assert_eq!(&key_slots_key(&h)[..13], &k[..13], "same slot");
        assert_eq!(&holds_key(&h)[..13], &k[..13], "same slot");
        assert_eq!(budget_and_holds_keys(&h), (k.clone(), holds_key(&h)));
        assert_ne!(holds_key(&h), named_budget_key(&h, "h"));
    }

    /// A give-back names the key by its tag, which spells its first 56 bits in full.
    #[test]
    fn a_tag_names_the_key_it_was_made_of() {
        for i in 0..200u32 {
            let h = crate::identity::hash_key(format!("key-{i}").as_bytes());
            assert_eq!(tag_bits_of(&key_tag(&h)), Some(tag_bits(&h)), "{i}");
        }
        let (a, b) = (
            crate::identity::hash_key(b"a"),
            crate::identity::hash_key(b"b"),
        );
        assert_ne!(tag_bits_of(&key_tag(&a)), Some(tag_bits(&b)));
        for bad in ["", "short", "abcdefghijk", "abc!efghij", "abcdefghi="] {
            assert_eq!(tag_bits_of(bad), None, "{bad}");
        }
    }

    /// Keys made on the stack are the very names Redis already holds (a gateway upgraded in
    /// a running fleet finds every budget where the others write it).
    #[test]
    fn the_layout_is_unchanged() {
        use base64::Engine;
        let h = crate::identity::hash_key(b"some-key");
        let t = &base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&h[..8])[..10];
        assert_eq!(key_tag(&h), t);
        assert_eq!(budget_key(&h), format!("t{{{t}}}b"));
        assert_eq!(holds_key(&h), format!("t{{{t}}}h"));
        assert_eq!(key_slots_key(&h), format!("t{{{t}}}f"));
        assert_eq!(admission_key(&h, "00ab:7"), format!("t{{{t}}}a00ab:7"));
    }
}
