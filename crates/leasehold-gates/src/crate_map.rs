//! Each backend crate's doc opens with a map of its files, one line per file.
//!
//! The map is the first list of the crate doc (`src/lib.rs`'s `//!` lines): no list or
//! heading comes before it, only the summary line and paragraphs. Each item is one line,
//! `` - `PATH`: what the file holds ``, with `PATH` relative to `src/`. It names every
//! `.rs` file under `src/` once, and no other file. A crate split into more files updates
//! its map; the gate says which files are missing or gone.

/// The crates whose docs open with a map.
pub const BACKENDS: &[&str] = &[
    "leasehold-etcd",
    "leasehold-file",
    "leasehold-postgres",
    "leasehold-redis",
    "leasehold-zookeeper",
];

/// The files `lib_rs`'s map names, in order, or why it has no map.
///
/// # Errors
///
/// If the crate doc has no list, or its first list or heading is not a map item, or an
/// item goes on past its line.
pub fn map(lib_rs: &str) -> Result<Vec<String>, String> {
    let doc: Vec<&str> = lib_rs
        .lines()
        .map(str::trim_start)
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!").trim_end())
        .collect();
    let opening = doc
        .iter()
        .position(|l| is_list_or_heading(l))
        .ok_or("the crate doc has no map of its files")?;
    let mut files = Vec::new();
    let mut rest = doc[opening..].iter();
    for line in rest.by_ref() {
        match item(line) {
            Some(path) => files.push(path.to_owned()),
            None if files.is_empty() => {
                return Err(format!(
                    "the crate doc opens with {:?}, not with a map of its files \
                     (`- `PATH`: what it holds`, one line per file)",
                    line.trim()
                ));
            }
            None if line.is_empty() => break,
            None => {
                return Err(format!(
                    "the map's item for `{}` goes on to {:?}: one line per file",
                    files.last().map_or("", String::as_str),
                    line.trim()
                ));
            }
        }
    }
    Ok(files)
}

/// Breaches of the rule: `lib_rs`'s map against `files`, the `.rs` files under `src/`.
pub fn violations(lib_rs: &str, files: &[String]) -> Vec<String> {
    let named = match map(lib_rs) {
        Ok(named) => named,
        Err(why) => return vec![why],
    };
    let mut found = Vec::new();
    for (i, path) in named.iter().enumerate() {
        if named[..i].contains(path) {
            found.push(format!("the map names `{path}` twice"));
        } else if !files.contains(path) {
            found.push(format!(
                "the map names `{path}`, which is not a file of src/"
            ));
        }
    }
    for file in files {
        if !named.contains(file) {
            found.push(format!("the map does not name src/{file}"));
        }
    }
    found
}

/// A Markdown list item or heading (a line of the crate doc, marker removed).
fn is_list_or_heading(line: &str) -> bool {
    let line = line.trim_start();
    let numbered = line
        .split_once(". ")
        .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    line.starts_with("- ") || line.starts_with("* ") || line.starts_with('#') || numbered
}

/// The path of a map item, `` - `PATH`: text ``.
fn item(line: &str) -> Option<&str> {
    let rest = line.strip_prefix(" - `")?;
    let (path, text) = rest.split_once('`')?;
    let text = text.strip_prefix(": ")?;
    (!path.is_empty() && !text.trim().is_empty()).then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    const GOOD: &str = "//! A backend.\n//!\n//! The crate:\n//!\n//! - `lib.rs`: exports.\n//! - `wire/mod.rs`: the protocol.\n//!\n//! - **Fast**: it is.\n\nmod wire;\n";

    #[test]
    fn a_map_that_names_every_file_passes() {
        assert_eq!(map(GOOD).unwrap(), ["lib.rs", "wire/mod.rs"]);
        assert!(violations(GOOD, &files(&["lib.rs", "wire/mod.rs"])).is_empty());
    }

    #[test]
    fn missing_gone_and_repeated_files_are_found() {
        let found = violations(GOOD, &files(&["lib.rs", "backend.rs"]));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].contains("`wire/mod.rs`, which is not a file"),
            "{found:?}"
        );
        assert!(
            found[1].contains("does not name src/backend.rs"),
            "{found:?}"
        );
        let twice = "//! A.\n//!\n//! - `lib.rs`: a.\n//! - `lib.rs`: b.\n";
        assert!(violations(twice, &files(&["lib.rs"]))[0].contains("twice"));
    }

    #[test]
    fn a_doc_that_does_not_open_with_the_map_is_found() {
        let late = "//! A.\n//!\n//! - **Fast**: it is.\n//!\n//! - `lib.rs`: exports.\n";
        assert!(map(late).unwrap_err().contains("not with a map"));
        let heading = "//! A.\n//!\n//! # Files\n//!\n//! - `lib.rs`: exports.\n";
        assert!(map(heading).is_err());
        assert!(map("//! A.\n//!\n//! No list.\n").is_err());
    }

    #[test]
    fn an_item_on_two_lines_is_found() {
        let wrapped = "//! A.\n//!\n//! - `lib.rs`: exports, and\n//!   more.\n";
        assert!(map(wrapped).unwrap_err().contains("one line per file"));
    }
}
