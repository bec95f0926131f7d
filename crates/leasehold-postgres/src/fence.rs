//! Fenced writes: what keeps a superseded holder's writes out of the data.
//! The checks run in the caller's own transaction.
//!
//! - [`still_owner`] — the condition that the guard's grant is still current, for the
//!   `WHERE` of the caller's `UPDATE`/`DELETE`/`INSERT … SELECT`. It also locks the grant's
//!   row, so a later grant of the lock (which must remove that row) waits until the caller's
//!   transaction has ended: the write commits only while the guard holds the lock. Works
//!   for data in the same database as the locks, in a `READ COMMITTED` transaction.
//!   [`StillOwner::verify`] runs the check as a statement of its own and counts refusals.
//! - [`TokenFence`] — for any table, anywhere: a column that keeps the highest token a row
//!   has accepted, and the condition that refuses a write carrying a lower one.
//!
//! ```no_run
//! # async fn example(guard: leasehold_core::Guard, db: &mut leasehold_postgres::tokio_postgres::Client)
//! # -> Result<(), Box<dyn std::error::Error>> {
//! let fence = leasehold_postgres::still_owner(&guard);
//! let tx = db.transaction().await?;
//! let changed = tx
//!     .execute(
//!         &format!(
//!             "UPDATE stock SET left = left - 1 WHERE item = $1 AND left > 0 AND {}",
//!             fence.condition(2)
//!         ),
//!         &[&"tea", &fence.name(), &fence.token(), &fence.owner()],
//!     )
//!     .await?;
//! tx.commit().await?; // changed == 0: sold out, or the lock was no longer ours
//! # let _ = changed; Ok(()) }
//! ```

use leasehold_core::{FencingToken, Guard, Result};
use tokio_postgres::GenericClient;

use crate::error::map;
use crate::options::{DEFAULT_SCHEMA, check_identifier};

/// The condition that a guard's grant is still current (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StillOwner {
    schema: String,
    name: String,
    token: i64,
    owner: String,
}

/// The condition that `guard` still holds its lock, for locks in the default schema.
/// That schema is `leasehold`; use [`StillOwner::in_schema`] or
/// [`PostgresBackend::still_owner`](crate::PostgresBackend::still_owner) for another.
///
/// Put [`condition`](StillOwner::condition) in the `WHERE` of a statement of the caller's
/// transaction, with [`name`](StillOwner::name), [`token`](StillOwner::token) and
/// [`owner`](StillOwner::owner) as its parameters: the statement changes rows only while the grant is current (its lease has
/// not run out on the server, or its advisory lock is still held), and the transaction then
/// keeps the next grant of the lock waiting until it ends.
///
/// The transaction must be `READ COMMITTED` (PostgreSQL's default): a `REPEATABLE READ` or
/// `SERIALIZABLE` snapshot hides grants and renewals committed after it was taken, so the
/// condition refuses to judge there and the statement fails with SQLSTATE `0A000`
/// (`feature_not_supported`), its message naming the level.
pub fn still_owner(guard: &Guard) -> StillOwner {
    StillOwner::new(DEFAULT_SCHEMA, guard)
}

/// A token as a `bigint` parameter.
/// Tokens come from a `bigint` sequence, so they fit; one that does not is made one that
/// matches no grant and no row.
pub fn token_param(token: FencingToken) -> i64 {
    i64::try_from(token.get()).unwrap_or(-1)
}

impl StillOwner {
    pub(crate) fn new(schema: &str, guard: &Guard) -> Self {
        let mut fence =
            Self::of_grant(guard.name().as_str(), guard.token(), guard.owner().as_str());
        schema.clone_into(&mut fence.schema);
        fence
    }

    /// The condition for a grant known by its parts, as its guard reports them.
    /// Its parts are the lock's name, the token and the owner id; the locks are in the
    /// default schema. It is for a process that checks writes on behalf of the holder (a
    /// service the holder sends them to).
    pub fn of_grant(name: &str, token: FencingToken, owner: &str) -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            name: name.to_owned(),
            token: token_param(token),
            owner: owner.to_owned(),
        }
    }

    /// The same condition for locks of `schema`.
    ///
    /// # Errors
    ///
    /// [`leasehold_core::Error::InvalidArgument`] for a schema name that is not 1–63 of
    /// `a-z 0-9 _`.
    pub fn in_schema(mut self, schema: &str) -> Result<Self> {
        check_identifier("schema", schema)?;
        self.schema = schema.to_owned();
        Ok(self)
    }

    /// The condition, `<schema>.holds($first, $first+1, $first+2)`.
    /// Pass [`name`](Self::name) as parameter `first`, then [`token`](Self::token) and
    /// [`owner`](Self::owner).
    pub fn condition(&self, first: usize) -> String {
        format!(
            "{}.holds(${first}, ${}, ${})",
            self.schema,
            first + 1,
            first + 2
        )
    }

    /// Checks, as a statement of its own in `client`'s transaction, that the grant is current.
    /// `Ok(true)`: it is, and every grant that would exclude this one now waits until the
    /// transaction ends, so every later statement of the transaction runs while the guard
    /// holds. Run it in the transaction itself, not in a savepoint: rolling a savepoint
    /// back releases the row lock that keeps the next grant waiting. `Ok(false)`:
    /// it is not (its lease ran out, or it was released or evicted); the refusal counts in
    /// `leasehold_fence_refusals_total{fence="postgres"}`. It costs one round trip more than
    /// the [`condition`](Self::condition) in the caller's own statement, which cannot tell
    /// a refusal from a `WHERE` that matched nothing (count those with
    /// [`count_refusal`](Self::count_refusal)).
    ///
    /// Outside a transaction the check ends with its statement and fences nothing after it.
    ///
    /// # Cancel safety
    ///
    /// One `SELECT`: dropped, it may have taken the grant's row lock for the rest of the
    /// transaction, and nothing else.
    ///
    /// # Errors
    ///
    /// Backend errors; under `REPEATABLE READ` or `SERIALIZABLE`, SQLSTATE `0A000` (see
    /// [`still_owner`]).
    pub async fn verify(&self, client: &impl GenericClient) -> Result<bool> {
        let row = client
            .query_one(
                &format!("SELECT {}", self.condition(1)),
                &[&self.name, &self.token, &self.owner],
            )
            .await
            .map_err(|e| map(e, "checking a grant"))?;
        let holds: bool = row
            .try_get(0)
            .map_err(|e| map(e, "reading a grant's check"))?;
        if !holds {
            self.count_refusal();
        }
        Ok(holds)
    }

    /// Counts one refusal of this condition in `leasehold_fence_refusals_total{fence="postgres"}`.
    /// For a statement of the caller's that carried the condition and changed nothing
    /// because of it.
    pub fn count_refusal(&self) {
        leasehold_core::telemetry::fence_refused("postgres");
    }

    /// The lock's name: the condition's first parameter.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The grant's token: the condition's second parameter.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The guard's owner id: the condition's third parameter.
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

/// A fencing-token column for any table.
/// A write carrying a token lower than the highest the row has accepted is refused (it
/// changes no row).
///
/// ```no_run
/// # async fn example(guard: leasehold_core::Guard, db: &leasehold_postgres::tokio_postgres::Client)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// use leasehold_postgres::fence::{TokenFence, token_param};
///
/// let fence = TokenFence::default(); // a column named fence_token
/// fence.add_column(db, "accounts").await?;
/// let changed = db
///     .execute(
///         &format!(
///             "UPDATE accounts SET balance = $1, {} WHERE id = $2 AND {}",
///             fence.assignment(3),
///             fence.condition(3)
///         ),
///         &[&100_i64, &7_i64, &token_param(guard.token())],
///     )
///     .await?;
/// // 0: a holder with a newer token has written this row; ours was refused.
/// # let _ = changed; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenFence {
    column: String,
}

impl Default for TokenFence {
    /// A column named `fence_token`.
    fn default() -> Self {
        Self {
            column: "fence_token".to_owned(),
        }
    }
}

impl TokenFence {
    /// A fence on the column `column` (1–63 of `a-z 0-9 _`).
    ///
    /// # Errors
    ///
    /// [`leasehold_core::Error::InvalidArgument`] for other names.
    pub fn new(column: &str) -> Result<Self> {
        check_identifier("fence column", column)?;
        Ok(Self {
            column: column.to_owned(),
        })
    }

    /// The column's name.
    pub fn column(&self) -> &str {
        &self.column
    }

    /// Adds the column (`bigint NOT NULL DEFAULT 0`) to `table` if it is not there yet.
    /// `table` is `name` or `schema.name`, each 1–63 of `a-z 0-9 _`.
    ///
    /// # Cancel safety
    ///
    /// One `ALTER TABLE` statement: dropped before it completed, the server either added
    /// the column or did not.
    ///
    /// # Errors
    ///
    /// [`leasehold_core::Error::InvalidArgument`] for a bad table name; backend errors
    /// (no such table, no privilege).
    pub async fn add_column(&self, client: &impl GenericClient, table: &str) -> Result<()> {
        for part in table.split('.') {
            check_identifier("table", part)?;
        }
        if table.split('.').count() > 2 {
            return Err(leasehold_core::Error::invalid(
                "table",
                format!("{table:?} is not name or schema.name"),
            ));
        }
        client
            .batch_execute(&format!(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {} bigint NOT NULL DEFAULT 0",
                self.column
            ))
            .await
            .map_err(|e| map(e, "adding the fence column"))
    }

    /// `<column> <= $param`: the write's token is not lower than the row's highest.
    /// It is true when the write's token (parameter `param`) is not lower than the highest
    /// the row has accepted.
    pub fn condition(&self, param: usize) -> String {
        format!("{} <= ${param}", self.column)
    }

    /// Counts one refusal of this fence in `leasehold_fence_refusals_total{fence="postgres_token"}`.
    /// For a write whose row was there but changed nothing because the row had accepted
    /// a newer token.
    pub fn count_refusal(&self) {
        leasehold_core::telemetry::fence_refused("postgres_token");
    }

    /// `<column> = $param`: records the write's token (parameter `param`) in the row.
    pub fn assignment(&self, param: usize) -> String {
        format!("{} = ${param}", self.column)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_name_their_parameters() {
        let fence = TokenFence::default();
        assert_eq!(fence.condition(3), "fence_token <= $3");
        assert_eq!(fence.assignment(3), "fence_token = $3");
        assert!(TokenFence::new("bad name").is_err());
        assert!(TokenFence::new("Fence").is_err());
        assert_eq!(token_param(FencingToken::new(5)), 5);
        assert_eq!(token_param(FencingToken::new(u64::MAX)), -1);
    }

    #[test]
    fn a_grant_known_by_its_parts_gives_the_same_condition() {
        let fence = StillOwner::of_grant("job", FencingToken::new(7), "o-1");
        assert_eq!(fence.condition(2), "leasehold.holds($2, $3, $4)");
        assert_eq!(
            (fence.name(), fence.token(), fence.owner()),
            ("job", 7, "o-1")
        );
        let other = fence.in_schema("locks").unwrap();
        assert_eq!(other.condition(1), "locks.holds($1, $2, $3)");
    }
}
