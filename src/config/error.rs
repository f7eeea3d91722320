//! Configuration errors, each with the path of the field in the file, formatted the same way
//! whether serde or a validation rule found the problem: `a.b."/x/y".c[0]`.

use std::fmt;

use super::bounds::MAX_REPORTED_ERRORS;

/// A configuration problem, always with the path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    pub(super) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Every problem found in one file (validation does not stop at the first).
#[derive(Debug, Clone, Default, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    pub(super) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError::new(path, message));
    }

    pub(super) fn one(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self(vec![ConfigError::new(path, message)])
    }

    /// The errors to show (the first [`MAX_REPORTED_ERRORS`]), and how many more there are.
    pub fn shown(&self) -> (&[ConfigError], usize) {
        let n = self.0.len().min(MAX_REPORTED_ERRORS);
        (&self.0[..n], self.0.len() - n)
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// A serde error as a [`ConfigError`], with the path in this module's format.
pub(super) fn from_serde(e: serde_path_to_error::Error<serde_yaml::Error>) -> ConfigError {
    ConfigError::new(format_path(e.path()), message(&e))
}

/// [`from_serde`] for the error of a file that is not YAML (`text`, the file). One that came
/// while the next key of a map was read (its path ends `?`: libyaml could not scan a key, e.g.
/// one over its 1,024 characters) names that map; and when the key it could not scan stands
/// no deeper in the file than the entry read before it (the entry's key, found in the lines
/// above, at the same column or right of it), that entry was read whole and is not at fault
/// either: the map around it is named. Its line and column say where.
pub(super) fn from_syntax(
    e: serde_path_to_error::Error<serde_yaml::Error>,
    text: &str,
) -> ConfigError {
    let segments: Vec<_> = e.path().iter().collect();
    let path = match segments.split_last() {
        Some((serde_path_to_error::Segment::Unknown, rest)) => {
            let scanned = scanned_key_at(&e.inner().to_string());
            let done = match (rest.last(), scanned) {
                (Some(serde_path_to_error::Segment::Map { key }), Some((line, column))) => {
                    key_column(text, key, line).is_some_and(|at| column <= at)
                }
                _ => false,
            };
            let rest = match rest.split_last() {
                Some((_, map)) if done => map,
                _ => rest,
            };
            format_segments(rest.iter().copied())
        }
        _ => format_path(e.path()),
    };
    ConfigError::new(path, message(&e))
}

/// Where libyaml's message says the key it could not scan starts: "while scanning a simple
/// key at line L column C" (1-based).
fn scanned_key_at(message: &str) -> Option<(usize, usize)> {
    let rest = message
        .split("while scanning a simple key at line ")
        .nth(1)?;
    let (line, rest) = rest.split_once(" column ")?;
    let column: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((line.trim().parse().ok()?, column.parse().ok()?))
}

/// The column (1-based) of the last line above `line` (1-based) that starts with `key` as a
/// mapping key (plain or quoted, followed by `:`).
fn key_column(text: &str, key: &str, line: usize) -> Option<usize> {
    let above: Vec<&str> = text.lines().take(line.saturating_sub(1)).collect();
    above.into_iter().rev().find_map(|l| {
        let body = l.trim_start();
        let column = l.len() - body.len() + 1;
        let body = body.strip_prefix("? ").unwrap_or(body);
        [key.to_string(), format!("\"{key}\""), format!("'{key}'")]
            .iter()
            .any(|k| {
                body.strip_prefix(k.as_str())
                    .is_some_and(|r| r.starts_with(':'))
            })
            .then_some(column)
    })
}

/// [`from_serde`] for a parse of text the file does not hold (its tree written out again):
/// without the line and column, which are not the file's.
pub(super) fn from_serde_unplaced(e: serde_path_to_error::Error<serde_yaml::Error>) -> ConfigError {
    let mut text = message(&e);
    if let Some(at) = e.inner().location() {
        let place = format!(" at line {} column {}", at.line(), at.column());
        if let Some(i) = text.rfind(&place) {
            text.replace_range(i..i + place.len(), "");
        }
    }
    ConfigError::new(format_path(e.path()), text)
}

/// True when serde stopped at a key that `deny_unknown_fields` refuses (its message is
/// serde's own `unknown field` wording); the error's path then ends with that key.
pub(super) fn is_unknown_field(e: &serde_path_to_error::Error<serde_yaml::Error>) -> bool {
    message(e).starts_with("unknown field `")
}

/// serde's message without the rendering of the path serde_yaml puts in front of it (ours
/// replaces it). Parsing text, serde_yaml appends " at line L column C": kept, it helps find
/// the spot.
fn message(e: &serde_path_to_error::Error<serde_yaml::Error>) -> String {
    let msg = e.inner().to_string();
    let text = match msg.strip_prefix(&format!("{}: ", e.path())) {
        Some(rest) => rest.to_string(),
        None => match msg.split_once(": ") {
            Some((head, tail)) if !head.contains(' ') => tail.to_string(),
            _ => msg,
        },
    };
    // serde's name for YAML's null (`~`, or a key with nothing after it).
    let text = match text.strip_prefix("invalid type: unit value, ") {
        Some(rest) => format!("no value given, {rest}"),
        None => text,
    };
    unquoted(&text)
}

/// A value from the file, as an error may repeat it: quoted when it is short and plain (a
/// typo of a word the field expects: `loca`, `cookie`), else only its length. A value in the
/// wrong place may be a secret (a raw key where the registry wants a map, a Redis URL with its
/// password where a word is expected, a PEM block), and errors go to logs and terminals.
pub(crate) fn shown(value: &str) -> String {
    match plain(value) {
        true => format!("\"{value}\""),
        false => withheld(value),
    }
}

fn plain(value: &str) -> bool {
    value.len() <= 16
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

fn withheld(value: &str) -> String {
    format!("a value of {} characters", value.chars().count())
}

/// [`shown`] for a path: quoted when it is one line and not PEM itself.
pub(crate) fn shown_path(value: &str) -> String {
    match value.contains('\n') || value.contains("-----BEGIN") {
        false => format!("\"{value}\""),
        true => format!(
            "a value of {} lines, not a path (PEM goes in a file the field names)",
            value.lines().count()
        ),
    }
}

/// serde's messages with the file's string values they quote (`invalid type: string "…"`,
/// ``unknown variant `…` ``) withheld unless [`shown`] would show them.
fn unquoted(text: &str) -> String {
    let mut out = text.to_string();
    if let Some(at) = out.find("invalid type: string \"") {
        let from = at + "invalid type: string ".len();
        // Debug-quoted by serde: up to the first quote not escaped.
        let mut escaped = false;
        let end = out[from + 1..].char_indices().find_map(|(i, c)| {
            let done = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            done.then_some(from + 1 + i + 1)
        });
        if let Some(end) = end {
            let quoted = out[from + 1..end - 1].to_string();
            if !plain(&quoted) {
                out.replace_range(from..end, &withheld(&quoted));
            }
        }
    }
    if let Some(at) = out.find("unknown variant `") {
        let from = at + "unknown variant ".len();
        if let Some(len) = out[from + 1..].find("`, ") {
            let end = from + 1 + len + 1;
            let value = out[from + 1..end - 1].to_string();
            if !plain(&value) {
                out.replace_range(from..end, &withheld(&value));
            }
        }
    }
    out
}

/// Formats a serde path the way the errors of this module do: `a.b."/x/y".c[0]`.
pub(super) fn format_path(path: &serde_path_to_error::Path) -> String {
    format_segments(path.iter())
}

/// [`format_path`] of a path's first segments (or of any run of them).
pub(super) fn format_segments<'a>(
    segments: impl IntoIterator<Item = &'a serde_path_to_error::Segment>,
) -> String {
    let mut out = String::new();
    for seg in segments {
        match seg {
            serde_path_to_error::Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key } => push_key(&mut out, key),
            serde_path_to_error::Segment::Enum { variant } => push_key(&mut out, variant),
            serde_path_to_error::Segment::Unknown => push_key(&mut out, "?"),
        }
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

fn push_key(out: &mut String, key: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        out.push_str(key);
    } else {
        out.push('"');
        out.push_str(&key.replace('"', "\\\""));
        out.push('"');
    }
}

/// `prefix` followed by a map key, quoted when it is not a plain word.
pub(super) fn key_path(prefix: &str, key: &str) -> String {
    let mut s = prefix.to_string();
    push_key(&mut s, key);
    s
}
