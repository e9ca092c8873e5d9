//! The repository stands alone: no file in it refers to a folder beside the checkout (the
//! project's private `shared` folder is not something a user's clone has). Everything the tests
//! and scripts need lives in the repository or is fetched by its own scripts.

use std::path::Path;

/// Files and folders not walked: build output and git's own data.
const SKIP: &[&str] = &["target", ".git"];

fn walk(dir: &Path, hits: &mut Vec<String>, needle: &str) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        let name = entry.file_name();
        if SKIP.iter().any(|s| name == *s) {
            continue;
        }
        if path.is_dir() {
            walk(&path, hits, needle);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            for (i, line) in text.lines().enumerate() {
                if line.contains(needle) {
                    hits.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
                }
            }
        }
    }
}

#[test]
fn no_file_refers_to_a_folder_beside_the_checkout() {
    // NOTE: built from parts so that this file does not match itself.
    let needle = ["..", "/", "shared"].concat();
    let mut hits = Vec::new();
    walk(Path::new(env!("CARGO_MANIFEST_DIR")), &mut hits, &needle);
    assert!(
        hits.is_empty(),
        "files refer to {needle}, which a clone of the repository does not have:\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_check_finds_a_reference() {
    // The walk must be able to fail: a file that names the folder is found.
    let dir = tempfile::tempdir().unwrap();
    let needle = ["..", "/", "shared"].concat();
    std::fs::write(
        dir.path().join("a.sh"),
        format!("run {needle}/tools/x.py\n"),
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("target")).unwrap();
    std::fs::write(dir.path().join("target/b.sh"), &needle).unwrap();
    let mut hits = Vec::new();
    walk(dir.path(), &mut hits, &needle);
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert!(hits[0].contains("a.sh:1:"));
}
