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
    // A text whose tree cannot be built is not YAML past the point the typed parse stopped
    // at (an unknown key before a line indented wrongly, say), or has a YAML tag, which no
    // field of the file takes: the first error, and the tree's when it is another.
    let Ok((mut tree, repeated)) = lenient_tree(text) else {
        let de = serde_yaml::Deserializer::from_str(text);
        let tree_error = serde_path_to_error::deserialize::<_, Value>(de).err();
        let at = |e: &ParseError| e.inner().location().map(|l| (l.line(), l.column()));
        let other = tree_error.filter(|t| at(t) != at(&first));
        errors.0.push(error::from_syntax(first, text));
        errors.0.extend(other.map(|e| error::from_syntax(e, text)));
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
    // Where stand-ins were put.
    let mut stood: Vec<String> = Vec::new();
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
        // What a stand-in lacks (a section stood in for as an empty map has none of its
        // fields) is mended like any mistake, but it is not the file's: not reported.
        let spot = error::format_segments(&path);
        if !stood.iter().any(|s| under(&spot, s)) {
            // Only the text's own parse knows where in the file it stopped.
            errors.0.push(match from_text {
                true => error::from_serde(e),
                false => error::from_serde_unplaced(e),
            });
        }
        if errors.0.len() >= MAX_REPORTED_ERRORS || parses >= MAX_PARSES {
            return Err(errors);
        }
        let mended = if unknown {
            remove(&mut tree, &path)
        } else if let Some(field) = missing_field(&message) {
            let mut at = path.clone();
            at.push(Segment::Map { key: field });
            stood.push(error::format_segments(&at));
            stand_in(&mut tree, &at, None, &mut parses) && mask(&mut masked, &path)
        } else {
            // The entry the value belongs to (a top-level value is its own; a map stood in for
            // is an entry of its own, so that its siblings are still checked): its other rules
            // may speak of the stand-in.
            stood.push(spot);
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
mod tests;
