//! The first line of a doc comment ends a sentence: summaries are one line.
//!
//! A doc comment is a run of consecutive lines that start (after indentation) with `///`
//! — not `////`, an ordinary comment — or a run that starts with `//!`. The text of its
//! first line, after the marker, must end with `.`, `!` or `?`, which closing brackets,
//! quotes, backticks or emphasis (`)]"'`*_`) may follow. It may hold more than one
//! sentence; it may not leave its first one for the next line, nor be empty. rustdoc
//! shows a doc comment's first paragraph as its summary wherever the item is listed: a
//! summary that is one line reads the same there, in the source and in an editor's hover.

/// Files that still break the rule, left to the parts of issue #25 that rework them.
///
/// Each is `(path from the workspace root, the part)`. The gate skips them, and fails when
/// one of them keeps the rule (or is gone): take it off the list then.
pub const PENDING: &[(&str, &str)] = &[];

/// Where `source`'s doc comments break the rule.
/// The line number and text of each first line that does not end a sentence.
pub fn violations(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut previous = None;
    for (i, line) in source.lines().enumerate() {
        let marker = marker(line);
        if let Some(m) = marker
            && previous != Some(m)
        {
            let text = line.trim_start()[m.len()..].trim();
            if !ends_sentence(text) {
                found.push((i + 1, line.trim().to_owned()));
            }
        }
        previous = marker;
    }
    found
}

/// Whether `text` ends a sentence, by the rule above.
pub fn ends_sentence(text: &str) -> bool {
    let text = text.trim_end_matches([')', ']', '"', '\'', '`', '*', '_']);
    text.ends_with(['.', '!', '?'])
}

/// The doc comment marker `line` starts with, if any.
fn marker(line: &str) -> Option<&'static str> {
    let line = line.trim_start();
    if line.starts_with("///") && !line.starts_with("////") {
        Some("///")
    } else if line.starts_with("//!") {
        Some("//!")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_on_one_line_passes() {
        let source =
            "/// One line. Two.\n/// More on the\n/// next.\nfn f() {}\n    /// Indented (too).\n";
        assert!(violations(source).is_empty());
        assert!(violations("//! A crate.\n//!\n//! More.\n").is_empty());
        assert!(ends_sentence("Calls [`f`](crate::f)."));
        assert!(ends_sentence("Is it `*`?"));
        assert!(ends_sentence("(It is.)"));
    }

    #[test]
    fn a_summary_that_goes_on_to_the_next_line_is_found() {
        let source = "fn a() {}\n/// The first sentence goes\n/// on here.\nfn f() {}\n";
        assert_eq!(
            violations(source),
            [(2, "/// The first sentence goes".to_owned())]
        );
        assert_eq!(violations("//! Lists:\n//! - a.\n").len(), 1);
        assert_eq!(violations("///\n/// Empty first line.\n").len(), 1);
    }

    #[test]
    fn each_block_is_judged_by_its_own_first_line() {
        // A `//!` run after a `///` run, and a `///` run after code, start blocks.
        let source = "/// Good.\n//! Bad\n//! still.\nlet x = 1;\n/// Bad\n/// too.\n";
        let lines: Vec<usize> = violations(source).into_iter().map(|(n, _)| n).collect();
        assert_eq!(lines, [2, 5]);
        assert!(violations("//// Not a doc comment\n").is_empty());
    }
}
