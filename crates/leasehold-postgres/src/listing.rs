//! Listings: the names under a prefix, a page at a time, in the order of their index.
//!
//! Each mode pages through an indexed column of names (`names.name`, `advisory.name`) in the
//! column's own order: one statement looks at the next `page` names after the cursor (the
//! last name the previous page looked at) and answers what inspect would for those under
//! the prefix. Where the column's collation sorts by code point (`C`, `POSIX`, `C.UTF-8`,
//! the builtin provider) the names under a prefix are one range of the index, and only that
//! range is read. A linguistic collation (`en_US.UTF-8`, ICU) weighs letters before
//! punctuation and case, which scatters them: every name is then looked at, and those
//! outside the prefix are skipped — each page is still one bounded statement. The server
//! is asked once per backend which it is.

use std::sync::OnceLock;

use leasehold_core::backend::ListCursor;
use leasehold_core::{NamePrefix, Result};
use tokio_postgres::types::ToSql;

use crate::connection::Pool;
use crate::reply;
use crate::statements::Stmt;

/// One page's request, as both modes' list statements take it.
#[derive(Debug)]
pub(crate) struct Page {
    prefix: String,
    /// Where the range read begins (inclusive).
    from: String,
    /// Where it ends (exclusive); `None`: at the end of the index.
    until: Option<String>,
    /// The cursor; `""` on the first page (every name is after it).
    after: String,
    /// How many names to look at.
    limit: usize,
}

impl Page {
    /// The page of at most `limit` names after `cursor` under `prefix`.
    /// The range is the prefix's only where the names sort by code point.
    pub(crate) fn new(
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        limit: usize,
        code_point_order: bool,
    ) -> Self {
        let prefix = prefix.as_str().to_owned();
        let (from, until) = match code_point_order {
            true => (prefix.clone(), successor(&prefix)),
            false => (String::new(), None),
        };
        Self {
            prefix,
            from,
            until,
            after: cursor.map_or_else(String::new, |c| c.as_str().to_owned()),
            limit: limit.max(1),
        }
    }

    /// How many names it looks at.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Runs `stmt`, a list statement, for this page on a connection of `pool`.
    pub(crate) async fn query(&self, pool: &Pool, stmt: Stmt) -> Result<Vec<tokio_postgres::Row>> {
        let limit = i64::try_from(self.limit).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 5] =
            [&self.prefix, &self.from, &self.until, &self.after, &limit];
        pool.get()
            .await?
            .query(stmt, &params, "listing locks")
            .await
    }
}

/// The first string after every string that begins with `prefix`, in code point order.
/// `None` for the empty prefix (no end).
fn successor(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        if let Some(next) = (u32::from(last) + 1..=u32::from(char::MAX)).find_map(char::from_u32) {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// Whether the name columns sort by code point, asked of the server the first time.
pub(crate) async fn code_point_order(known: &OnceLock<bool>, pool: &Pool) -> Result<bool> {
    if let Some(known) = known.get() {
        return Ok(*known);
    }
    let row = pool
        .get()
        .await?
        .query_one(Stmt::CodePointOrder, &[], "listing locks")
        .await?;
    let answer = reply::single(&row, "listing locks")?;
    Ok(*known.get_or_init(|| answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_at_its_successor() {
        assert_eq!(successor("jobs:").as_deref(), Some("jobs;"));
        assert_eq!(successor("a-z").as_deref(), Some("a-{"));
        assert_eq!(successor(""), None);
        // No code point after the last one: the range ends after the one before.
        assert_eq!(successor("a\u{10FFFF}").as_deref(), Some("b"));
        assert_eq!(successor("\u{D7FF}").as_deref(), Some("\u{E000}"));
    }

    #[test]
    fn a_page_reads_the_prefix_range_only_under_code_point_order() {
        let prefix = NamePrefix::new("jobs:").unwrap();
        let cursor = ListCursor::new("jobs:7");
        let ranged = Page::new(&prefix, Some(&cursor), 0, true);
        assert_eq!(
            (ranged.from.as_str(), ranged.until.as_deref()),
            ("jobs:", Some("jobs;"))
        );
        assert_eq!((ranged.after.as_str(), ranged.limit()), ("jobs:7", 1));
        let scanned = Page::new(&prefix, None, 1000, false);
        assert_eq!(
            (scanned.from.as_str(), scanned.until.as_deref()),
            ("", None)
        );
        assert_eq!((scanned.after.as_str(), scanned.limit()), ("", 1000));
    }
}
