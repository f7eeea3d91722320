//! Limits on what a config file can make the gateway do before and while it is validated.
//!
//! serde_yaml (libyaml) spends seconds on a few hundred kilobytes of nested `[`, and names of
//! 64 KiB break the tables `tollgate check` prints. A real gateway.yaml is a few kilobytes,
//! nested five or six levels, with short names; the limits below are far above that.

use super::error::ConfigErrors;

/// Largest gateway.yaml accepted.
pub(super) const MAX_FILE_BYTES: u64 = 4 << 20;
/// Deepest nesting of mappings and sequences (block or flow) accepted.
pub(super) const MAX_DEPTH: usize = 64;
/// Longest plan name or key id (they go into headers, metric labels and URLs).
pub(super) const MAX_NAME_CHARS: usize = 128;
/// Longest endpoint pattern (a route label in every metric series of the route).
pub(super) const MAX_PATTERN_CHARS: usize = 2048;

pub(super) fn check_size(bytes: u64) -> Result<(), ConfigErrors> {
    if bytes > MAX_FILE_BYTES {
        return Err(ConfigErrors::one(
            ".",
            format!("the file is {bytes} bytes, more than the 4 MiB a gateway.yaml may have"),
        ));
    }
    Ok(())
}

/// Refuses text nested deeper than [`MAX_DEPTH`], in one pass over the text and without
/// parsing YAML. It over-counts rather than under-counts: brackets in plain scalars count as
/// nesting (quoted strings and comments are skipped), and every deeper indentation or `- `
/// counts as a level.
pub(super) fn check_depth(text: &str) -> Result<(), ConfigErrors> {
    let mut flow = 0usize;
    // Indentation columns of the open block levels.
    let mut indents: Vec<usize> = Vec::new();
    let mut quote: Option<u8> = None;
    for (n, line) in text.lines().enumerate() {
        let bytes = line.as_bytes();
        let mut i = 0;
        if quote.is_none() && flow == 0 {
            let indent = bytes.iter().take_while(|&&b| b == b' ').count();
            let rest = &bytes[indent..];
            if rest.is_empty() || rest[0] == b'#' {
                continue;
            }
            while indents.last().is_some_and(|&top| top > indent) {
                indents.pop();
            }
            if indents.last() != Some(&indent) {
                indents.push(indent);
            }
            // `- - x` opens a sequence per dash on one line.
            i = indent;
            let mut dashes = 0;
            while bytes.get(i) == Some(&b'-') && matches!(bytes.get(i + 1), Some(b' ') | None) {
                dashes += 1;
                i += 2;
            }
            if indents.len() + dashes > MAX_DEPTH {
                return Err(too_deep(n));
            }
        }
        let mut prev = b' ';
        while i < bytes.len() {
            let b = bytes[i];
            match quote {
                Some(b'"') if b == b'\\' => i += 1,
                Some(q) if b == q => {
                    // '' inside a single-quoted string is an escaped quote.
                    if q == b'\'' && bytes.get(i + 1) == Some(&b'\'') {
                        i += 1;
                    } else {
                        quote = None;
                    }
                }
                Some(_) => {}
                None => match b {
                    b'#' if prev == b' ' || prev == b'\t' => break,
                    b'"' | b'\'' if matches!(prev, b' ' | b'\t' | b'[' | b'{' | b',' | b':') => {
                        quote = Some(b)
                    }
                    b'[' | b'{' => {
                        flow += 1;
                        if indents.len() + flow > MAX_DEPTH {
                            return Err(too_deep(n));
                        }
                    }
                    b']' | b'}' => flow = flow.saturating_sub(1),
                    _ => {}
                },
            }
            prev = b;
            i += 1;
        }
    }
    Ok(())
}

fn too_deep(line: usize) -> ConfigErrors {
    ConfigErrors::one(
        ".",
        format!(
            "nested deeper than {MAX_DEPTH} levels (line {}); a gateway.yaml needs a handful",
            line + 1
        ),
    )
}

/// A name or pattern as shown in an error: short enough to read, and marked when cut.
pub(super) fn shown(s: &str) -> String {
    const SHOWN: usize = 48;
    match s.char_indices().nth(SHOWN) {
        None => s.to_string(),
        Some((end, _)) => format!("{}…", &s[..end]),
    }
}
