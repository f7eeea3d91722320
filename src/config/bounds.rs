//! Limits on what a config file can make the gateway do before and while it is validated.
//!
//! serde_yaml (libyaml) spends seconds on a few hundred kilobytes of nested flow collections,
//! and names of 64 KiB broke the tables `tollgate check` prints. A real gateway.yaml is a few kilobytes,
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
/// Most errors reported of one file by the typed parse (each costs a parse of the file's tree).
pub(super) const MAX_REPORTED_ERRORS: usize = 100;

/// A config file's bytes, one past [`MAX_FILE_BYTES`] at most: a device or a pipe, whose size
/// the file system does not know (`/dev/zero`, `/dev/stdin`), is refused at the bound instead
/// of read without end.
pub fn read_bounded(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

pub(super) fn check_size(bytes: u64) -> Result<(), ConfigErrors> {
    if bytes > MAX_FILE_BYTES {
        return Err(ConfigErrors::one(
            ".",
            format!("the file is {bytes} bytes, more than the 4 MiB a gateway.yaml may have"),
        ));
    }
    Ok(())
}

/// Refuses text nested deeper than [`MAX_DEPTH`]. The nesting is measured by libyaml, the
/// parser serde_yaml itself uses, so that no quoting trick makes the two disagree; it reads
/// event by event and stops at the first level too deep, so the work stays proportional to
/// the part of the file that is read (serde_yaml reads every event first, whose cost grows
/// with the depth of flow collections: 100k nested `{a: ` take seconds).
pub(super) fn check_depth(text: &str) -> Result<(), ConfigErrors> {
    use unsafe_libyaml as unsafe_yaml;

    // Boxed and never moved: a string-input parser points at itself.
    let mut parser = Box::new(std::mem::MaybeUninit::<unsafe_yaml::yaml_parser_t>::uninit());
    let parser = parser.as_mut_ptr();
    // SAFETY: `parser` is valid for writes and initialized before any other use; `text`
    // outlives it (deleted below, before returning).
    unsafe {
        if unsafe_yaml::yaml_parser_initialize(parser).fail {
            // Out of memory: serde_yaml will say so.
            return Ok(());
        }
        unsafe_yaml::yaml_parser_set_encoding(parser, unsafe_yaml::YAML_UTF8_ENCODING);
        unsafe_yaml::yaml_parser_set_input_string(parser, text.as_ptr(), text.len() as u64);
    }
    let mut depth = 0usize;
    let mut too_deep_at = None;
    loop {
        let mut event = std::mem::MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
        let event = event.as_mut_ptr();
        // SAFETY: `parser` is initialized; a successfully parsed `event` is read, then
        // deleted exactly once.
        let (kind, line) = unsafe {
            if unsafe_yaml::yaml_parser_parse(parser, event).fail {
                // A syntax error: serde_yaml reports it with its path and position.
                break;
            }
            let seen = ((*event).type_, (*event).start_mark.line);
            unsafe_yaml::yaml_event_delete(event);
            seen
        };
        match kind {
            unsafe_yaml::YAML_SEQUENCE_START_EVENT | unsafe_yaml::YAML_MAPPING_START_EVENT => {
                depth += 1;
                if depth > MAX_DEPTH {
                    too_deep_at = Some(line as usize);
                    break;
                }
            }
            unsafe_yaml::YAML_SEQUENCE_END_EVENT | unsafe_yaml::YAML_MAPPING_END_EVENT => {
                depth = depth.saturating_sub(1)
            }
            unsafe_yaml::YAML_STREAM_END_EVENT => break,
            _ => {}
        }
    }
    // SAFETY: initialized above and not used after this.
    unsafe { unsafe_yaml::yaml_parser_delete(parser) };
    match too_deep_at {
        Some(line) => Err(too_deep(line)),
        None => Ok(()),
    }
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
