//! Commit subjects of at most 72 characters.
//!
//! Checked for the commits after [`BASE`], the last commit before the gate: older subjects
//! broke the rule before anything checked it, and history is not rewritten. A checkout
//! without that history (not a git checkout, or a shallow clone that stops after it) has
//! nothing to check; the gate says so and passes.

/// The last commit before the gate.
pub const BASE: &str = "afeb2127918360d5b500bd933f19f42bb26e3738";

/// The longest subject, in characters.
pub const MAX: usize = 72;

/// Breaches of the rule in `log`: lines of `git log --format='%h %s'`, one message each.
pub fn violations(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| {
            let (hash, subject) = line.split_once(' ').unwrap_or((line, ""));
            let length = subject.chars().count();
            (length > MAX).then(|| format!("{hash}: {length} characters: {subject}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_over_72_characters_are_found() {
        let fits = "x".repeat(MAX);
        let long = "é".repeat(MAX + 1);
        let log = format!("abc1234 {fits}\ndef5678 {long}\n");
        let found = violations(&log);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("def5678: 73 characters"), "{found:?}");
    }
}
