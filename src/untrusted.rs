//! Text that comes from a file (GGUF keys and strings, config.json values, tensor names), made
//! fit to print in an error message or a log line: escaped, so that control characters,
//! newlines and terminal escape sequences cannot forge lines or drive a terminal, and cut, so
//! that one corrupt value cannot produce a message of hundreds of kilobytes.

use std::fmt::Write;
use std::path::Path;

/// At most this many characters of escaped text are kept.
pub const MAX_CHARS: usize = 200;

/// `s` escaped with [`char::escape_debug`] (quotes excepted, so that names read as they are)
/// and cut after [`MAX_CHARS`] characters with an ellipsis and the full length.
pub fn text(s: &str) -> String {
    escaped(s, &['"', '\''])
}

/// `s` with every character but those in `keep` escaped, cut after [`MAX_CHARS`] characters.
fn escaped(s: &str, keep: &[char]) -> String {
    let mut out = String::new();
    let mut shown = 0;
    for c in s.chars() {
        let start = out.len();
        if keep.contains(&c) {
            out.push(c);
        } else {
            out.extend(c.escape_debug());
        }
        shown += out[start..].chars().count();
        if shown > MAX_CHARS {
            out.truncate(start);
            let _ = write!(out, "… ({} bytes in all)", s.len());
            break;
        }
    }
    out
}

/// A JSON value, compact, cut like [`text`]. serde_json has escaped the control characters
/// of its strings already (so backslashes are kept as they are); what it leaves, such as
/// bidirectional overrides, is escaped here.
pub fn json(v: &serde_json::Value) -> String {
    escaped(&v.to_string(), &['"', '\'', '\\'])
}

/// What kind of file system object this is, for error messages.
pub fn file_kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// The metadata of `path`, symbolic links followed; `Ok(None)` when nothing is there. A
/// dangling link and every other failure (a loop of links, no permission) are errors that say
/// so.
pub fn metadata(path: &Path) -> anyhow::Result<Option<std::fs::Metadata>> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Ok(target) = std::fs::read_link(path) {
                anyhow::bail!(
                    "{} is a symbolic link to {}, which does not exist",
                    path.display(),
                    target.display()
                );
            }
            Ok(None)
        }
        Err(e) => anyhow::bail!("cannot access {}: {e}", path.display()),
    }
}

/// Checks, before it is opened, that the optional file `path` is a regular file where it
/// exists: `Ok(false)` when it does not.
///
/// NOTE: opening a FIFO blocks until a writer comes and a device may read forever, so a model
/// path of the wrong type would hang the load instead of failing.
pub fn optional_regular_file(path: &Path) -> anyhow::Result<bool> {
    match metadata(path)? {
        None => Ok(false),
        Some(m) if m.is_file() => Ok(true),
        Some(m) => anyhow::bail!(
            "{} is {}, not a regular file",
            path.display(),
            file_kind(&m.file_type())
        ),
    }
}

/// Checks that `path` exists and is a regular file, before it is opened.
pub fn regular_file(path: &Path) -> anyhow::Result<()> {
    if !optional_regular_file(path)? {
        anyhow::bail!("{} does not exist", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_quotes_kept() {
        assert_eq!(text("llama.block_count"), "llama.block_count");
        assert_eq!(text("a'b\"c"), "a'b\"c");
        assert_eq!(text("x\n\x1b[31mred\r\t"), "x\\n\\u{1b}[31mred\\r\\t");
        // bidirectional overrides and other invisible format characters
        assert_eq!(text("a\u{202e}b"), "a\\u{202e}b");
        assert_eq!(text("\\"), "\\\\");
        assert_eq!(text(""), "");
    }

    #[test]
    fn long_text_is_cut_with_its_length() {
        let s = "é".repeat(1000);
        let t = text(&s);
        assert!(t.starts_with(&"é".repeat(MAX_CHARS)), "{t}");
        assert!(t.ends_with("… (2000 bytes in all)"), "{t}");
        assert!(t.chars().count() < MAX_CHARS + 30);
        // escapes count towards the limit
        let t = text(&"\x01".repeat(10_000));
        assert!(t.chars().count() < MAX_CHARS + 30, "{t}");
        assert_eq!(text(&"a".repeat(MAX_CHARS)), "a".repeat(MAX_CHARS));
    }

    #[test]
    fn json_values_are_compact_and_cut() {
        assert_eq!(json(&serde_json::json!("64")), "\"64\"");
        assert_eq!(json(&serde_json::json!({"a": [1, 2]})), "{\"a\":[1,2]}");
        let big = serde_json::Value::Array(vec![1.into(); 100_000]);
        assert!(json(&big).len() < 300);
        assert_eq!(
            json(&serde_json::json!("\u{1b}\u{202e}")),
            "\"\\u001b\\u{202e}\""
        );
    }
}
