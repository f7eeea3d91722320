//! The path as a request spells it, reduced to the one form that is classified (and, for
//! [`normalize_path`], forwarded): what a framework upstream would resolve to the same handler
//! must be charged as that handler.

use std::borrow::Cow;

/// Why a path cannot be classified safely (→ 400 `bad-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadPath {
    #[error("the path must start with '/'")]
    NotAbsolute,
    #[error("a CONNECT request names host:port, not a path, and the gateway opens no tunnels")]
    Connect,
    #[error("the path contains an encoded '/' or '\\'")]
    EncodedSeparator,
    #[error("the path contains a backslash")]
    Backslash,
    #[error("the path contains a NUL or control character")]
    ControlChar,
    #[error("the path contains an invalid percent-encoding")]
    BadEncoding,
    #[error(
        "the path has a '..;' segment, which servers that strip matrix parameters resolve as '..'"
    )]
    DotDotParameter,
    #[error("the path has a non-ASCII letter that case-folds to an ASCII one and so spells another route")]
    CaseFold,
    #[error("the path has an escaped ':', '@' or sub-delimiter and spells another route with it unescaped")]
    EscapedDelimiter,
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Canonical form of a request path (no query):
/// - percent-encoded unreserved characters are decoded, other escapes are upper-cased, and
///   raw non-ASCII bytes are escaped (a character has one spelling);
/// - encoded `/` or `\`, backslashes, NUL and control characters are refused;
/// - `//` collapses, `.` and `..` segments resolve (never above the root);
/// - a trailing `/` is dropped (`/reports/generate/` is `/reports/generate`).
pub fn normalize_path(path: &str) -> Result<Cow<'_, str>, BadPath> {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(BadPath::NotAbsolute);
    }
    if is_canonical(bytes) {
        // The common case: nothing to decode, refuse or resolve, and no allocation.
        return Ok(Cow::Borrowed(path));
    }
    // Pass 1: decode what may be decoded, refuse what can't be classified.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'%' => {
                let (Some(h), Some(l)) = (
                    bytes.get(i + 1).copied().and_then(hex_val),
                    bytes.get(i + 2).copied().and_then(hex_val),
                ) else {
                    return Err(BadPath::BadEncoding);
                };
                let v = h << 4 | l;
                if v == b'/' || v == b'\\' {
                    return Err(BadPath::EncodedSeparator);
                }
                if v < 0x20 || v == 0x7f {
                    return Err(BadPath::ControlChar);
                }
                if is_unreserved(v) {
                    decoded.push(v);
                } else {
                    decoded.extend_from_slice(&[
                        b'%',
                        bytes[i + 1].to_ascii_uppercase(),
                        bytes[i + 2].to_ascii_uppercase(),
                    ]);
                }
                i += 3;
            }
            b'\\' => return Err(BadPath::Backslash),
            0..=0x1f | 0x7f => return Err(BadPath::ControlChar),
            // A raw non-ASCII byte is the same character as its escape (`/€` is
            // `/%E2%82%AC`): one spelling for both. So is a raw ASCII byte that a path may
            // not hold unescaped (RFC 3986 §3.3): `/q|x` is `/q%7Cx`, one route, one cost,
            // whichever a client sends (an upstream that decodes runs the same handler).
            0x80.. | b' ' | b'"' | b'<' | b'>' | b'^' | b'`' | b'{' | b'|' | b'}' | b'[' | b']' => {
                decoded.extend_from_slice(percent_encoding::percent_encode_byte(b).as_bytes());
                i += 1;
            }
            _ => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    // Pass 2: resolve segments.
    let mut out: Vec<&[u8]> = Vec::new();
    for seg in decoded.split(|&b| b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => {
                out.pop();
            }
            // Refused here, before a later `..` resolves it away (`/x/..;/../y`): a server
            // that strips matrix parameters resolves the pair differently (`/y`'s parent).
            s if s.starts_with(b"..;") => return Err(BadPath::DotDotParameter),
            s => out.push(s),
        }
    }
    let mut s = String::with_capacity(decoded.len());
    if out.is_empty() {
        s.push('/');
    }
    for seg in out {
        s.push('/');
        // Only ASCII is left: escapes, and unreserved bytes decoded.
        s.push_str(std::str::from_utf8(seg).map_err(|_| BadPath::BadEncoding)?);
    }
    Ok(Cow::Owned(s))
}

/// True when `normalize_path` would return the path unchanged: no escapes, backslashes or
/// control characters, no empty, `.` or `..` segment, no trailing `/`.
pub(super) fn is_canonical(bytes: &[u8]) -> bool {
    let mut prev = 0u8;
    // Dots since the last '/', or -1 once the segment has another byte: a segment of exactly
    // one or two dots is `.` or `..`.
    let mut dots = 0;
    for &b in bytes {
        match b {
            b'%' | b'\\' | 0..=0x1f | 0x7f | 0x80.. => return false,
            b' ' | b'"' | b'<' | b'>' | b'^' | b'`' | b'{' | b'|' | b'}' | b'[' | b']' => {
                return false
            }
            b'/' => {
                if prev == b'/' || dots == 1 || dots == 2 {
                    return false;
                }
                dots = 0;
            }
            b'.' if dots >= 0 => dots += 1,
            _ => dots = -1,
        }
        prev = b;
    }
    !(dots == 1 || dots == 2 || (prev == b'/' && bytes.len() > 1))
}

/// The path as routes are matched (DESIGN §3): matrix parameters (`;name=value`, which Tomcat
/// and Spring strip from every segment) are removed, and a segment that is empty or `.` once
/// they are gone is dropped. A `..;…` segment is refused: such servers resolve it as `..`.
/// Takes a [`normalize_path`] result; borrows it when it has no `;` (the common case).
pub fn match_path(normalized: &str) -> Result<Cow<'_, str>, BadPath> {
    if !normalized.contains(';') {
        return Ok(Cow::Borrowed(normalized));
    }
    let mut out = String::with_capacity(normalized.len());
    for seg in normalized.split('/').skip(1) {
        let name = seg.split(';').next().unwrap_or(seg);
        match name {
            "" | "." => {}
            ".." => return Err(BadPath::DotDotParameter),
            name => {
                out.push('/');
                out.push_str(name);
            }
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

/// `path` with the escapes of `:`, `@` and the sub-delimiters `!$&'()*+,=` (RFC 3986 §2.2; not
/// `;`, whose escape is no matrix parameter) read as those characters, None when it has none:
/// an upstream framework that decodes a path before routing it (WSGI, CGI, Go's `URL.Path`)
/// runs `/v1/r:generate` for `/v1/r%3Agenerate`, one that routes the raw path (Express) does
/// not. A path whose two spellings are two routes cannot be classified safely
/// (`Router::route_of`); an endpoint is written unescaped (`check`).
pub fn decode_delims(path: &str) -> Option<String> {
    if !path.contains('%') {
        return None;
    }
    let bytes = path.as_bytes();
    let decoded = |i: usize| {
        if bytes[i] != b'%' {
            return None;
        }
        let v = hex_val(*bytes.get(i + 1)?)? << 4 | hex_val(*bytes.get(i + 2)?)?;
        matches!(
            v,
            b':' | b'@' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b'='
        )
        .then_some(v)
    };
    if !(0..bytes.len()).any(|i| decoded(i).is_some()) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match decoded(i) {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    // Only ASCII bytes were put in place of ASCII escapes.
    String::from_utf8(out).ok()
}

/// The value of a `%XY` escape at `i` when it encodes a non-ASCII byte.
fn high_escape(bytes: &[u8], i: usize) -> Option<u8> {
    if bytes.get(i) != Some(&b'%') {
        return None;
    }
    let v = hex_val(*bytes.get(i + 1)?)? << 4 | hex_val(*bytes.get(i + 2)?)?;
    (v >= 0x80).then_some(v)
}

/// Appends what `c` folds to when that is ASCII letters only (`ſ` → `s`, `ı` → `i`, `K`
/// (Kelvin) → `k`, `ﬁ` → `fi`), by lower- or upper-casing; false (nothing appended) otherwise.
fn push_ascii_fold(c: char, out: &mut String) -> bool {
    if c.is_ascii() {
        return false;
    }
    if c.to_lowercase().all(|l| l.is_ascii_alphabetic()) {
        out.extend(c.to_lowercase());
        return true;
    }
    if c.to_uppercase().all(|u| u.is_ascii_alphabetic()) {
        out.extend(c.to_uppercase().map(|u| u.to_ascii_lowercase()));
        return true;
    }
    false
}

/// `path` with every non-ASCII letter that case-folds to ASCII letters replaced by them, raw
/// or percent-encoded (an upstream that folds Unicode case would read it so); everything else
/// as it was. `None` when there is no such letter — without allocating for an ASCII path.
pub fn fold_to_ascii(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let has_high = |i: usize| bytes[i] >= 0x80 || high_escape(bytes, i).is_some();
    if !(0..bytes.len()).any(has_high) {
        return None;
    }
    let mut out = String::with_capacity(path.len());
    let mut folded = false;
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let mut run = Vec::new();
        while let Some(v) = high_escape(bytes, i) {
            run.push(v);
            i += 3;
        }
        if run.is_empty() {
            // `i` is at a char boundary: escapes and chars are consumed whole.
            let Some(c) = path[i..].chars().next() else {
                break;
            };
            if !push_ascii_fold(c, &mut out) {
                out.push(c);
            } else {
                folded = true;
            }
            i += c.len_utf8();
            continue;
        }
        // Each escaped character: its fold, or its escapes as they were.
        let mut at = start;
        for chunk in run.utf8_chunks() {
            for c in chunk.valid().chars() {
                let end = at + 3 * c.len_utf8();
                if push_ascii_fold(c, &mut out) {
                    folded = true;
                } else {
                    out.push_str(&path[at..end]);
                }
                at = end;
            }
            let end = at + 3 * chunk.invalid().len();
            out.push_str(&path[at..end]);
            at = end;
        }
    }
    folded.then_some(out)
}
