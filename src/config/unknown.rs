//! Every unknown key of a file, not only the first.
//!
//! serde's `deny_unknown_fields` stops the typed parse at the first key it does not know, so a
//! file with a misspelt key and three other mistakes would show one error. Which keys each
//! section knows is serde's business (the derived `RawConfig`), so it is not written down a
//! second time here: the file is read into a YAML tree once, and each unknown key serde names
//! is recorded and removed from the tree before the typed parse is tried again, until the tree
//! parses (then the other rules are checked too) or serde stops at something else.

use super::bounds::MAX_UNKNOWN_KEYS;
use super::error::{self, ConfigErrors};
use super::raw::RawConfig;

/// Goes on from `first`, the text parse's unknown-field error: the config with every unknown
/// key left out, and those keys' errors in file order. `Err` with every error found when the
/// file does not parse even without them.
pub(super) fn every_unknown_key(
    text: &str,
    first: serde_path_to_error::Error<serde_yaml::Error>,
) -> Result<(RawConfig, ConfigErrors), ConfigErrors> {
    let mut errors = ConfigErrors::default();
    // The text parse got this far, so the text is YAML; a tree that cannot be built (a key
    // repeated in a map the typed parse had not reached) leaves the first error alone.
    let Ok(mut tree) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        errors.0.push(error::from_serde(first));
        return Err(errors);
    };
    let mut unknown = first;
    loop {
        let removed = remove(&mut tree, unknown.path());
        errors.0.push(error::from_serde(unknown));
        if !removed || errors.0.len() >= MAX_UNKNOWN_KEYS {
            return Err(errors);
        }
        match serde_path_to_error::deserialize::<_, RawConfig>(&tree) {
            Ok(raw) => return Ok((raw, errors)),
            Err(e) if error::is_unknown_field(&e) => unknown = e,
            Err(e) => {
                errors.0.push(error::from_serde(e));
                return Err(errors);
            }
        }
    }
}

/// Removes the entry that `path` names (a map key, the last segment) from `tree`; false when
/// the path leads nowhere in the tree.
fn remove(tree: &mut serde_yaml::Value, path: &serde_path_to_error::Path) -> bool {
    use serde_path_to_error::Segment;

    let segments: Vec<&Segment> = path.iter().collect();
    let Some((Segment::Map { key }, parents)) = segments.split_last() else {
        return false;
    };
    let mut node = tree;
    for seg in parents {
        let next = match seg {
            Segment::Map { key } => node.get_mut(key.as_str()),
            Segment::Seq { index } => node.get_mut(*index),
            Segment::Enum { .. } | Segment::Unknown => None,
        };
        let Some(next) = next else { return false };
        node = next;
    }
    node.as_mapping_mut()
        .and_then(|m| m.shift_remove(key.as_str()))
        .is_some()
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, EnvOverrides};

    fn errors(text: &str) -> Vec<String> {
        match Config::parse(text, &EnvOverrides::default()) {
            Ok(_) => vec![],
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    const BASE: &str = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n";

    /// Unknown keys in a list entry and in a map of endpoints, with nothing else wrong: each
    /// one is reported (and the file is refused).
    #[test]
    fn unknown_keys_in_lists_and_maps_are_all_reported() {
        let text = format!(
            "{BASE}  endpoints:\n    /a: {{cost: 1, colour: red}}\nplans:\n  pro:\n    budgets:\n      - {{name: m, max_cost: 5, window: 1m, size: 3}}\n"
        );
        let errs = errors(&text);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[0].starts_with("rate_limits.endpoints.\"/a\".colour: unknown field `colour`"),
            "{errs:?}"
        );
        assert!(
            errs[1].starts_with("plans.pro.budgets[0].size: unknown field `size`"),
            "{errs:?}"
        );
    }

    /// After the unknown keys, a type error still stops the parse: both are reported.
    #[test]
    fn a_type_error_after_an_unknown_key_is_reported_too() {
        let text = format!("server: {{listn: x, threads: many}}\n{BASE}");
        let errs = errors(&text);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[0].starts_with("server.listn: unknown field"),
            "{errs:?}"
        );
        assert!(
            errs[1].starts_with("server.threads: invalid type"),
            "{errs:?}"
        );
    }

    /// A file of many unknown keys is not parsed once per key without end.
    #[test]
    fn unknown_keys_are_reported_up_to_a_bound() {
        let keys: String = (0..500).map(|i| format!("  k{i}: 1\n")).collect();
        let errs = errors(&format!("server:\n{keys}{BASE}"));
        assert_eq!(errs.len(), super::MAX_UNKNOWN_KEYS, "{}", errs.len());
    }
}
