//! Maps whose keys may appear only once (DESIGN §1), where serde would keep the last.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// A map in which a key may appear only once. serde's maps keep the last of two equal keys,
/// which would silently drop the first endpoint or plan of that name (DESIGN §1: an error).
pub(super) fn unique_keys<'de, D, V>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(PhantomData<V>);

    impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                let value = map.next_value_seed(Value {
                    repeated: out.contains_key(&key),
                    value: PhantomData,
                })?;
                out.insert(key, value);
            }
            Ok(out)
        }
    }

    d.deserialize_map(Unique(PhantomData))
}

/// A map value, refused when its key was seen before. The refusal comes from inside the
/// value so that `serde_path_to_error` reports the path of the repeated key, and from a
/// visitor so that serde_yaml reports the line of the repeated entry (not of the map).
struct Value<V> {
    repeated: bool,
    value: PhantomData<V>,
}

impl<'de, V: Deserialize<'de>> DeserializeSeed<'de> for Value<V> {
    type Value = V;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<V, D::Error> {
        if self.repeated {
            return d.deserialize_any(Repeated(PhantomData));
        }
        V::deserialize(d)
    }
}

pub(in crate::config) const REPEATED: &str =
    "appears twice in this map; each key may appear only once";

/// Refuses whatever value it is given.
struct Repeated<V>(PhantomData<V>);

macro_rules! refuse {
    ($($name:ident: $t:ty),*) => {
        $(fn $name<E: serde::de::Error>(self, _: $t) -> Result<V, E> {
            Err(E::custom(REPEATED))
        })*
    };
}

impl<'de, V> Visitor<'de> for Repeated<V> {
    type Value = V;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REPEATED)
    }

    refuse!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);

    fn visit_unit<E: serde::de::Error>(self) -> Result<V, E> {
        Err(E::custom(REPEATED))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<V, A::Error> {
        Err(serde::de::Error::custom(REPEATED))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<V, A::Error> {
        Err(serde::de::Error::custom(REPEATED))
    }
}
