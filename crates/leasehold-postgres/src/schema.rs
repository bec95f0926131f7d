//! The schema's tables and functions, made on first use.
//!
//! Migrations are versioned (`<schema>.version`) and run in one transaction holding a
//! transaction-level advisory lock of the schema, so that clients starting together apply
//! each one exactly once. An up-to-date schema costs one query and needs no privilege beyond
//! using its tables: no superuser ever, and `CREATE` on the database only to make the
//! schema itself.

use leasehold_core::Result;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::error::{map, undecodable};

/// The migrations, in order: version `i + 1` is `MIGRATIONS[i]`.
/// Version 1 is the schema; version 2 adds force-release (the `evictions` table and `evict`);
/// version 3 adds records beside a lock (the `records` table); version 4 redefines advisory
/// mode's grant and release (the session's start read once per session, the release's
/// answer from the unlock itself, index scans rather than bitmap scans); version 5 adds
/// change feeds (the `watchers` table, and a message on the feed channel from every grant,
/// release, queue change and eviction while a watcher follows the name).
const MIGRATIONS: &[&str] = &[
    include_str!("../sql/v1.sql"),
    include_str!("../sql/v2.sql"),
    include_str!("../sql/v3.sql"),
    include_str!("../sql/v4.sql"),
    include_str!("../sql/v5.sql"),
];

/// The channel wake-ups of `schema` are sent on.
pub(crate) fn channel(schema: &str) -> String {
    format!("{schema}.wake")
}

/// The channel change feeds of `schema` listen on (see `sql/v5.sql`).
/// As long as the wake-up channel's name, so that it fits in an identifier too.
pub(crate) fn feed_channel(schema: &str) -> String {
    format!("{schema}.feed")
}

/// The text of migration `sql` for `schema`.
fn render(sql: &str, schema: &str) -> String {
    sql.replace("@schema@", schema)
        .replace("@channel@", &channel(schema))
}

/// The first column of the first row of a simple query's answer.
fn first_value(messages: &[SimpleQueryMessage]) -> Option<Option<&str>> {
    messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(row) => Some(row.get(0)),
        _ => None,
    })
}

/// The schema's version: 0 when it has no version table yet.
async fn version(client: &Client, schema: &str) -> Result<i64> {
    let doing = "reading the schema version";
    let query = async |sql: String| {
        let answer = client.simple_query(&sql).await.map_err(|e| map(e, doing))?;
        first_value(&answer)
            .flatten()
            .map(str::to_owned)
            .ok_or_else(|| undecodable(doing, "no row"))
    };
    let exists = query(format!(
        "SELECT to_regclass('{schema}.version') IS NOT NULL"
    ))
    .await?;
    if exists != "t" {
        return Ok(0);
    }
    let version = query(format!(
        "SELECT coalesce(max(version), 0) FROM {schema}.version"
    ))
    .await?;
    version.parse().map_err(|_| undecodable(doing, version))
}

/// Brings `schema` up to the latest version.
///
/// # Errors
///
/// Backend errors (e.g. no privilege to create the schema).
pub(crate) async fn migrate(client: &Client, schema: &str) -> Result<()> {
    let latest = MIGRATIONS.len() as i64;
    if version(client, schema).await? >= latest {
        return Ok(());
    }
    let doing = "migrating the schema";
    // One transaction: the lock is held until it commits, and a failure leaves nothing.
    let begin = format!(
        "BEGIN; SELECT pg_advisory_xact_lock(hashtextextended('leasehold migrate {schema}', 0))"
    );
    client
        .batch_execute(&begin)
        .await
        .map_err(|e| map(e, doing))?;
    let outcome = async {
        let exists = client
            .simple_query(&format!("SELECT to_regnamespace('{schema}') IS NOT NULL"))
            .await
            .map_err(|e| map(e, doing))?;
        if first_value(&exists).flatten() != Some("t") {
            client
                .batch_execute(&format!("CREATE SCHEMA {schema}"))
                .await
                .map_err(|e| map(e, doing))?;
        }
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {schema}.version (version integer NOT NULL)"
            ))
            .await
            .map_err(|e| map(e, doing))?;
        let current = version(client, schema).await?;
        for (i, sql) in MIGRATIONS.iter().enumerate() {
            let to = i as i64 + 1;
            if to <= current {
                continue;
            }
            client
                .batch_execute(&render(sql, schema))
                .await
                .map_err(|e| map(e, doing))?;
            client
                .batch_execute(&format!(
                    "DELETE FROM {schema}.version; INSERT INTO {schema}.version VALUES ({to})"
                ))
                .await
                .map_err(|e| map(e, doing))?;
        }
        Ok(())
    }
    .await;
    let end = if outcome.is_ok() {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    let ended = client.batch_execute(end).await.map_err(|e| map(e, doing));
    outcome.and(ended)
}
