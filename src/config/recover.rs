//! Every error of a file, not only the first serde stops at (DESIGN §1: "`tollgate check`
//! reports every error with its path in the file").
//!
//! The typed parse stops at the first key it does not know, the first value of the wrong type,
//! the first missing field and the first repeated key. Which keys each section knows and what
//! type each value has is serde's business (the derived `RawConfig`), so none of it is written
//! down a second time here. Instead the file is read once into a YAML tree — keeping the first
//! of two equal keys and recording each repetition — and the typed parse is tried on the tree
//! again and again, each time after mending the spot it stopped at:
//! - an unknown key is removed;
//! - a value of the wrong type is replaced by the first stand-in of a short list that gets
//!   the parse past that spot (a number, a duration, a word, a map…);
//! - a missing field gets such a stand-in.
//!
//! Each spot is reported once. When the tree parses, the other rules are checked too, except
//! under an entry that holds a stand-in: what validation would say of a stand-in is not the
//! user's mistake. The work is bounded: at most [`MAX_PARSES`] typed parses of the tree.

use std::cell::RefCell;
use std::fmt;

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_path_to_error::Segment;
use serde_yaml::{Mapping, Number, Value};

use super::bounds::MAX_REPORTED_ERRORS;
use super::error::{self, ConfigError, ConfigErrors};
use super::raw::unique::REPEATED;
use super::raw::RawConfig;

/// Most typed parses of the tree one file may cost.
const MAX_PARSES: usize = 150;

type ParseError = serde_path_to_error::Error<serde_yaml::Error>;

/// What a file that did not parse at once still yields: the config with its mistakes mended,
/// every mistake found, and the entries whose validation errors are not to be shown.
pub(super) struct Recovered {
    pub raw: RawConfig,
    pub errors: ConfigErrors,
    pub masked: Masked,
}

/// The entries that hold a stand-in.
pub(super) struct Masked(Vec<String>);

impl Masked {
    /// False for a validation error under an entry that holds a stand-in.
    pub fn shows(&self, e: &ConfigError) -> bool {
        !self.0.iter().any(|m| under(&e.path, m))
    }
}

/// `path` is `entry` or inside it.
fn under(path: &str, entry: &str) -> bool {
    path.strip_prefix(entry)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.') || rest.starts_with('['))
}

/// Goes on from `first`, the text parse's error. `Err` with every error found when the file
/// cannot be mended into one that parses.
pub(super) fn every_error(text: &str, first: ParseError) -> Result<Recovered, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    // The text parse got this far, so the text is YAML; a tree that cannot be built anyway
    // (a YAML tag, which no field of the file takes) leaves the first error alone.
    let Ok((mut tree, repeated)) = lenient_tree(text) else {
        errors.0.push(error::from_serde(first));
        return Err(errors);
    };
    if tree.is_null() {
        // An empty file (or one of comments only) is an empty map: what is missing from it is
        // every section that must be there, and each is said.
        tree = Value::Mapping(Mapping::new());
    }
    let mut pending = None;
    if is_repeat(&first.inner().to_string()) {
        // The tree keeps only the first of the two keys: the typed parse will not meet the
        // repetition again, and the builder reported it too (without the line: this one has it).
        let shown = at_the_field(error::from_serde(first));
        let path = shown.path.clone();
        errors.0.push(shown);
        errors
            .0
            .extend(repeated.into_iter().filter(|e| e.path != path));
    } else {
        errors.0.extend(repeated);
        pending = Some(first);
    }

    let mut masked = Vec::new();
    let mut parses = 0;
    loop {
        let from_text = pending.is_some();
        let e = match pending.take() {
            Some(e) => e,
            None => {
                parses += 1;
                match typed(&tree) {
                    Ok(raw) => {
                        let masked = Masked(masked);
                        return Ok(Recovered {
                            raw,
                            errors,
                            masked,
                        });
                    }
                    Err(e) => e,
                }
            }
        };
        let path: Vec<Segment> = e.path().iter().cloned().collect();
        let message = e.inner().to_string();
        let unknown = error::is_unknown_field(&e);
        // Only the text's own parse knows where in the file it stopped.
        errors.0.push(match from_text {
            true => error::from_serde(e),
            false => error::from_serde_unplaced(e),
        });
        if errors.0.len() >= MAX_REPORTED_ERRORS || parses >= MAX_PARSES {
            return Err(errors);
        }
        let mended = if unknown {
            remove(&mut tree, &path)
        } else if let Some(field) = missing_field(&message) {
            let mut at = path.clone();
            at.push(Segment::Map { key: field });
            stand_in(&mut tree, &at, None, &mut parses) && mask(&mut masked, &path)
        } else {
            // The entry the value belongs to (a top-level value is its own; a map stood in for
            // is an entry of its own, so that its siblings are still checked): its other rules
            // may speak of the stand-in.
            stand_in(&mut tree, &path, first_variant(&message), &mut parses) && {
                let whole = matches!(node(&mut tree, &path), Some(Value::Mapping(_)));
                let entry = match path.len() {
                    0 | 1 => &path[..],
                    _ if whole => &path[..],
                    n => &path[..n - 1],
                };
                mask(&mut masked, entry)
            }
        };
        if !mended {
            return Err(errors);
        }
    }
}

/// The typed parse of the tree, as the file's text would be parsed: serde_yaml's tree reads
/// a null as an empty map, so that `/b: ~` would pass where the text's parse refuses it.
fn typed(tree: &Value) -> Result<RawConfig, ParseError> {
    match serde_yaml::to_string(tree) {
        Ok(text) => serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(&text)),
        Err(_) => serde_path_to_error::deserialize(tree),
    }
}

/// Records `entry` as holding a stand-in; true, to be chained after [`stand_in`].
fn mask(masked: &mut Vec<String>, entry: &[Segment]) -> bool {
    masked.push(error::format_segments(entry));
    true
}

/// A repeated key (serde's message): the tree builder reports every one of them.
fn is_repeat(message: &str) -> bool {
    message.contains(REPEATED) || message.contains("duplicate field `")
}

/// serde's "duplicate field `x`" is said at the section that has it twice: said at the
/// field, as the tree's repetitions are (and so reported once), keeping its line.
fn at_the_field(mut e: ConfigError) -> ConfigError {
    const DUPLICATE: &str = "duplicate field `";
    let Some(rest) = e.message.strip_prefix(DUPLICATE) else {
        return e;
    };
    let Some(end) = rest.find('`') else { return e };
    let field = &rest[..end];
    e.path = match e.path.as_str() {
        "." | "" => field.to_string(),
        section => format!("{section}.{field}"),
    };
    e.message = format!("{REPEATED}{}", &rest[end + 1..]);
    e
}

/// The field a "missing field `x`" message names.
fn missing_field(message: &str) -> Option<String> {
    let rest = &message[message.find("missing field `")? + "missing field `".len()..];
    Some(rest[..rest.find('`')?].to_string())
}

/// For a word that is none of a field's choices, the first choice serde's message lists
/// ("unknown variant `x`, expected `a` or `b`", or "expected one of `a`, `b`, `c`"): the
/// stand-in that fits.
fn first_variant(message: &str) -> Option<String> {
    let expected = &message[message.find("unknown variant `")?..];
    let choices = &expected[expected.find(", expected ")? + ", expected ".len()..];
    let rest = &choices[choices.find('`')? + 1..];
    Some(rest[..rest.find('`')?].to_string())
}

/// Puts at `at` the first stand-in that gets the typed parse past that spot (or to a missing
/// field inside it, which is mended next). False, with the tree as it was, when none does.
fn stand_in(tree: &mut Value, at: &[Segment], variant: Option<String>, parses: &mut usize) -> bool {
    let before = node(tree, at).cloned();
    let spot = error::format_segments(at);
    for candidate in variant.map(Value::String).into_iter().chain([
        Value::Number(Number::from(1_000_000_000u64)),
        Value::Number(Number::from(1000u64)),
        Value::Number(Number::from(1u64)),
        Value::String("1s".into()),
        Value::Bool(true),
        Value::String("x".into()),
        Value::Mapping(Mapping::new()),
        Value::Sequence(Vec::new()),
    ]) {
        if *parses >= MAX_PARSES || !set(tree, at, candidate) {
            break;
        }
        *parses += 1;
        match typed(tree) {
            Ok(_) => return true,
            Err(e) => {
                let missing = missing_field(&e.inner().to_string()).is_some();
                if missing || error::format_path(e.path()) != spot {
                    return true;
                }
            }
        }
    }
    match before {
        Some(v) => set(tree, at, v),
        None => remove(tree, at),
    };
    false
}

/// The node at `at` in `tree`, if the path leads anywhere.
fn node<'t>(tree: &'t mut Value, at: &[Segment]) -> Option<&'t mut Value> {
    at.iter().try_fold(tree, |node, seg| match seg {
        Segment::Map { key } => node.get_mut(key.as_str()),
        Segment::Seq { index } => node.get_mut(*index),
        Segment::Enum { .. } | Segment::Unknown => None,
    })
}

/// Sets (or adds, for the last map key) the value at `at`. False when the path leads nowhere.
fn set(tree: &mut Value, at: &[Segment], value: Value) -> bool {
    let Some((last, parents)) = at.split_last() else {
        return false;
    };
    let Some(parent) = node(tree, parents) else {
        return false;
    };
    match (last, parent) {
        (Segment::Map { key }, Value::Mapping(m)) => {
            m.insert(Value::String(key.clone()), value);
            true
        }
        (Segment::Seq { index }, Value::Sequence(s)) if *index < s.len() => {
            s[*index] = value;
            true
        }
        _ => false,
    }
}

/// Removes the entry that `path` names (a map key, the last segment) from `tree`; false when
/// the path leads nowhere in the tree.
fn remove(tree: &mut Value, path: &[Segment]) -> bool {
    let Some((Segment::Map { key }, parents)) = path.split_last() else {
        return false;
    };
    node(tree, parents)
        .and_then(|n| n.as_mapping_mut())
        .and_then(|m| m.shift_remove(key.as_str()))
        .is_some()
}

/// The file as a YAML tree in which a key repeated in a map keeps its first value, and every
/// repetition as an error at its path.
fn lenient_tree(text: &str) -> Result<(Value, Vec<ConfigError>), serde_yaml::Error> {
    let repeated = RefCell::new(Vec::new());
    let tree = Node {
        path: String::new(),
        repeated: &repeated,
    }
    .deserialize(serde_yaml::Deserializer::from_str(text))?;
    Ok((tree, repeated.into_inner()))
}

/// One node of the tree being built, with its path for the errors.
struct Node<'r> {
    path: String,
    repeated: &'r RefCell<Vec<ConfigError>>,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Node {
            path: format!("{}[{}]", self.path, out.len()),
            repeated: self.repeated,
        })? {
            out.push(v);
        }
        Ok(Value::Sequence(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Mapping::new();
        while let Some(key) = map.next_key::<Value>()? {
            let name = match &key {
                Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other)
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            };
            let path = error::key_path(&self.path, &name);
            let value = map.next_value_seed(Node {
                path: path.clone(),
                repeated: self.repeated,
            })?;
            if out.contains_key(&key) {
                self.repeated
                    .borrow_mut()
                    .push(ConfigError::new(path, REPEATED));
            } else {
                out.insert(key, value);
            }
        }
        Ok(Value::Mapping(out))
    }
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

    /// The paths of the errors, in the order reported.
    fn paths(text: &str) -> Vec<String> {
        match Config::parse(text, &EnvOverrides::default()) {
            Ok(_) => vec![],
            Err(e) => e.0.into_iter().map(|e| e.path).collect(),
        }
    }

    /// The file's errors are exactly as many as `starts`, each beginning with its own.
    fn errors_start(text: &str, starts: &[&str]) {
        let errs = errors(text);
        assert_eq!(errs.len(), starts.len(), "{errs:?}");
        for (e, start) in errs.iter().zip(starts) {
            assert!(e.starts_with(start), "{errs:?}");
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
        errors_start(
            &text,
            &[
                "rate_limits.endpoints.\"/a\".colour: unknown field `colour`",
                "plans.pro.budgets[0].size: unknown field `size`",
            ],
        );
    }

    /// A word that is none of a field's three or more choices (serde: "expected one of `a`,
    /// `b`, `c`") stands in as the first: the errors after it are reported too.
    #[test]
    fn an_unknown_choice_among_many_hides_no_later_error() {
        let text = format!(
            "store: {{backend: memory, on_error: maybe}}\n{BASE}  endpoints: {{/b: {{cost: 0}}}}\nbogus_top: 1\n"
        );
        let paths = paths(&text);
        for want in [
            "store.on_error",
            "bogus_top",
            "rate_limits.endpoints.\"/b\".cost",
        ] {
            assert!(paths.iter().any(|p| p == want), "{want} not in {paths:?}");
        }
    }

    /// An empty file, or one of comments only, is missing what `{}` is missing.
    #[test]
    fn an_empty_file_says_everything_that_is_missing() {
        let want = paths("{}");
        assert!(want.len() > 1, "{want:?}");
        for text in ["", "# nothing yet\n", "---\n"] {
            assert_eq!(paths(text), want, "{text:?}");
        }
    }

    /// After the unknown keys, a type error is reported too, and the stand-in put in its place
    /// (a thousand million threads) draws no error of its own.
    #[test]
    fn a_type_error_after_an_unknown_key_is_reported_too() {
        let text = format!("server: {{listn: x, threads: many}}\n{BASE}");
        errors_start(
            &text,
            &[
                "server.listn: unknown field",
                "server.threads: invalid type",
            ],
        );
    }

    /// An endpoint given no settings (`/b: ~`) stands in as a whole: the endpoints beside it
    /// are still checked (before, every endpoint's errors were masked with it).
    #[test]
    fn an_endpoint_without_settings_does_not_hide_its_siblings() {
        let text = format!("{BASE}  endpoints:\n    /b: ~\n    /c: {{cost: 0}}\n");
        assert_eq!(
            paths(&text),
            [
                "rate_limits.endpoints.\"/b\"",
                "rate_limits.endpoints.\"/c\".cost"
            ]
        );
    }

    /// Two endpoints given no settings are both reported: the tree is parsed as the text is
    /// (serde_yaml's tree reads a null as an empty map, so the second once passed unseen).
    #[test]
    fn every_endpoint_without_settings_is_reported() {
        let text =
            format!("{BASE}  endpoints:\n    /a: ~\n    /b: ~\n    /c:\n    /d: {{cost: 0}}\n");
        assert_eq!(
            paths(&text),
            [
                "rate_limits.endpoints.\"/a\"",
                "rate_limits.endpoints.\"/b\"",
                "rate_limits.endpoints.\"/c\"",
                "rate_limits.endpoints.\"/d\".cost"
            ]
        );
        let errs = errors(&text);
        assert!(
            errs[1].ends_with(
                "no value given, expected an endpoint's settings, a map like {cost: 20}"
            ),
            "{errs:?}"
        );
    }

    /// DESIGN §1: every error, with its path. A duration without a unit (a type error that
    /// stopped the typed parse) no longer hides the rules checked after it.
    #[test]
    fn a_type_error_does_not_hide_the_other_errors() {
        let text = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60, max_cost: 120}\n  endpoints:\n    /reports/generate: {cost: 0}\n    /b//c: {cost: 2}\n    /d: {cost: x}\n";
        assert_eq!(
            paths(text),
            [
                "rate_limits.default.window",
                "rate_limits.endpoints.\"/d\".cost",
                "rate_limits.endpoints.\"/b//c\"",
                "rate_limits.endpoints.\"/reports/generate\".cost",
            ]
        );
    }

    /// Every repeated key is reported, and the first of each is still checked: here its cost
    /// is not a number.
    #[test]
    fn every_repeated_key_is_reported_and_the_rest_checked() {
        let text = format!(
            "{BASE}  endpoints:\n    /a: {{cost: 0}}\n    /b: {{cost: x}}\n    /b: {{cost: 2}}\nplans:\n  p1: {{max_cost: 5, window: 1m}}\n  p1: {{max_cost: 6, window: 1m}}\nupstreams:\n  u: {{url: \"http://127.0.0.1:1\"}}\n  u: {{url: \"http://127.0.0.1:2\"}}\n"
        );
        let errs = errors(&text);
        let paths: Vec<&str> = errs.iter().map(|e| e.split(": ").next().unwrap()).collect();
        assert_eq!(
            paths,
            [
                "rate_limits.endpoints.\"/b\"",
                "plans.p1",
                "upstreams.u",
                "rate_limits.endpoints.\"/b\".cost",
                "rate_limits.endpoints.\"/a\".cost",
            ],
            "{errs:?}"
        );
        assert!(errs[0].contains("appears twice"), "{errs:?}");
    }

    /// A field repeated in a section (serde names it at the section) is one error, at the
    /// field's own path, with its line where serde gives one; before, it was reported twice,
    /// once at the section (`.` for the top level).
    #[test]
    fn a_repeated_field_is_one_error_at_its_path() {
        let text = format!("{BASE}upstream: {{url: \"http://127.0.0.1:3001\"}}\n");
        assert_eq!(
            errors(&text),
            ["upstream: appears twice in this map; each key may appear only once"]
        );
        let text = BASE.replace("max_cost: 120}", "max_cost: 120, cost: 2}");
        assert_eq!(
            errors(&text),
            ["rate_limits.default.cost: appears twice in this map; each key may appear only once at line 3 column 12"]
        );
    }

    /// A word that is none of a field's choices gets the first choice as its stand-in, so
    /// the parse goes on to the next mistake (a size below zero) and to validation (a budget
    /// wrong in both of its limits).
    #[test]
    fn an_unknown_choice_and_a_bad_size_are_both_reported() {
        let text = "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 0s, max_cost: 0}\n  endpoints:\n    /x: {cost: 5, max_in_flight: 2, async: {when: sometimes, max_response_body: -1}}\n";
        let errs = errors(text);
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert!(
            errs[0].starts_with(
                "rate_limits.endpoints.\"/x\".async.when: unknown variant `sometimes`"
            ),
            "{errs:?}"
        );
        assert_eq!(
            errs[1],
            "rate_limits.endpoints.\"/x\".async.max_response_body: invalid type: integer `-1`, expected a size like 512KiB, 1MiB or 16MiB, or a number of bytes"
        );
        assert_eq!(
            errs[2],
            "rate_limits.default.max_cost: must be a positive integer, got 0"
        );
        assert_eq!(
            errs[3],
            "rate_limits.default.window: must be greater than 0"
        );
    }

    /// A missing field is reported once: the stand-in put in its place lets the rest of the
    /// file be checked, and what validation would say of the stand-in is not shown.
    #[test]
    fn a_missing_field_is_reported_once() {
        let text = "upstream: {connect_timeout: 2s}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n  endpoints:\n    /a: {cost: 0}\n";
        errors_start(
            text,
            &[
                "upstream: missing field `url`",
                "rate_limits.endpoints.\"/a\".cost",
            ],
        );
    }

    /// A file of many unknown keys is not parsed once per key without end.
    #[test]
    fn unknown_keys_are_reported_up_to_a_bound() {
        let keys: String = (0..500).map(|i| format!("  k{i}: 1\n")).collect();
        let errs = errors(&format!("server:\n{keys}{BASE}"));
        assert_eq!(errs.len(), super::MAX_REPORTED_ERRORS, "{}", errs.len());
    }

    /// Nor one of many type errors: each mends with at most a few parses, and the whole
    /// is bounded.
    #[test]
    fn type_errors_are_reported_up_to_a_bound() {
        let eps: String = (0..300)
            .map(|i| format!("    /e{i}: {{cost: [1]}}\n"))
            .collect();
        let errs = errors(&format!("{BASE}  endpoints:\n{eps}"));
        assert!(
            errs.len() >= 10 && errs.len() <= super::MAX_REPORTED_ERRORS,
            "{}",
            errs.len()
        );
    }
}
