//! Every statement the backend sends, defined once.
//! Its SQL (with the schema written in) and the types of its parameters.
//!
//! On a connection of its own a statement is prepared once and then sent as Bind/Execute:
//! one round trip. Through a transaction-pooling proxy, where a prepared statement may be
//! gone by the next transaction, the same text is sent with its types each time (Parse,
//! Bind, Execute in one message batch — one round trip too).

use tokio_postgres::types::Type;

/// A statement of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stmt {
    /// Lease mode: grant or busy (see `acquire` in `sql/v1.sql`).
    Acquire,
    /// Lease mode: owner-checked extension of a live lease; answers one row or none.
    Renew,
    /// Lease mode: owner-checked removal of a grant or queue entry.
    Release,
    /// Lease mode: holders and waiters of a name.
    Inspect,
    /// Both modes: drop what vanished holders left behind.
    Sweep,
    /// Advisory mode: take the name's lock on this session, with a token.
    AdvisoryAcquire,
    /// Advisory mode: this session's token for the name, if it holds it.
    AdvisoryHeld,
    /// Advisory mode: give up this session's hold.
    AdvisoryRelease,
    /// Advisory mode: holders and waiters of a name.
    AdvisoryInspect,
    /// Advisory mode: whether a server process waits in an advisory lock's queue.
    AdvisoryQueued,
    /// The server process of this connection.
    Ping,
}

impl Stmt {
    /// Every statement a connection prepares.
    pub(crate) const ALL: [Stmt; 11] = [
        Stmt::Acquire,
        Stmt::Renew,
        Stmt::Release,
        Stmt::Inspect,
        Stmt::Sweep,
        Stmt::AdvisoryAcquire,
        Stmt::AdvisoryHeld,
        Stmt::AdvisoryRelease,
        Stmt::AdvisoryInspect,
        Stmt::AdvisoryQueued,
        Stmt::Ping,
    ];

    /// Its place in [`ALL`](Stmt::ALL).
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The SQL, with `@schema@` standing for the schema.
    fn template(self) -> &'static str {
        match self {
            Stmt::Acquire => {
                "SELECT o_token, o_retry_ms, o_waited_ms, o_blocked \
                 FROM @schema@.acquire($1, $2, $3, $4, $5, $6, $7, $8, $9)"
            }
            Stmt::Renew => {
                "UPDATE @schema@.grants SET expires = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE name = $1 AND owner = $2 AND expires > clock_timestamp() RETURNING true"
            }
            Stmt::Release => "SELECT @schema@.release($1, $2)",
            Stmt::Inspect => {
                "SELECT true AS holder, g.owner, g.mode::text, g.permit_limit, g.token, \
                        greatest(0, ceil(extract(epoch FROM g.expires - clock_timestamp()) * 1000))::bigint, \
                        g.value, g.mode = 'p' AS permit, 0 AS unfair, g.token AS ord \
                 FROM @schema@.grants g WHERE g.name = $1 AND g.expires > clock_timestamp() \
                 UNION ALL \
                 SELECT false, w.owner, w.mode::text, w.permit_limit, NULL, NULL, NULL, \
                        w.mode = 'p', CASE WHEN w.fair THEN 0 ELSE 1 END, w.seq \
                 FROM @schema@.waiters w WHERE w.name = $1 AND w.expires > clock_timestamp() \
                 ORDER BY holder DESC, permit, unfair, ord"
            }
            Stmt::Sweep => "SELECT @schema@.sweep($1)",
            Stmt::AdvisoryAcquire => "SELECT @schema@.advisory_acquire($1, $2, $3, $4, $5, $6)",
            Stmt::AdvisoryHeld => "SELECT @schema@.advisory_held($1)",
            Stmt::AdvisoryRelease => "SELECT @schema@.advisory_release($1, $2)",
            Stmt::AdvisoryInspect => {
                "SELECT l.granted, CASE WHEN l.granted THEN a.owner \
                            ELSE substr(s.application_name, 11) END, \
                        CASE WHEN l.mode = 'ShareLock' THEN 's' ELSE 'x' END, \
                        a.token, \
                        CASE WHEN s.state = 'idle' THEN greatest(0, a.session_ttl_ms \
                             - floor(extract(epoch FROM clock_timestamp() - s.state_change) * 1000))::bigint \
                             ELSE a.session_ttl_ms END, \
                        a.value \
                 FROM pg_locks l \
                 LEFT JOIN pg_stat_activity s ON s.pid = l.pid \
                 LEFT JOIN @schema@.advisory a ON a.pid = l.pid AND a.name = $1 \
                      AND (s.backend_start IS NULL OR a.started = s.backend_start) \
                 WHERE l.locktype = 'advisory' AND l.objsubid = 1 \
                   AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) \
                   AND ((l.classid::bigint << 32) | l.objid::bigint) = @schema@.advisory_key($1) \
                   AND (NOT l.granted OR a.token IS NOT NULL) \
                 ORDER BY l.granted DESC, a.token, l.waitstart"
            }
            Stmt::AdvisoryQueued => {
                "SELECT EXISTS (SELECT 1 FROM pg_locks l \
                 WHERE l.pid = $1 AND l.locktype = 'advisory' AND NOT l.granted)"
            }
            Stmt::Ping => "SELECT pg_backend_pid()",
        }
    }

    /// The SQL for `schema`.
    pub(crate) fn sql(self, schema: &str) -> String {
        self.template().replace("@schema@", schema)
    }

    /// The types of its parameters, in order.
    pub(crate) fn types(self) -> &'static [Type] {
        match self {
            Stmt::Acquire => &[
                Type::TEXT,
                Type::TEXT,
                Type::CHAR,
                Type::INT4,
                Type::INT8,
                Type::BOOL,
                Type::BOOL,
                Type::INT8,
                Type::BYTEA,
            ],
            Stmt::Renew => &[Type::TEXT, Type::TEXT, Type::INT8],
            Stmt::Release => &[Type::TEXT, Type::TEXT],
            Stmt::Inspect | Stmt::AdvisoryHeld | Stmt::AdvisoryInspect => &[Type::TEXT],
            Stmt::AdvisoryAcquire => &[
                Type::TEXT,
                Type::TEXT,
                Type::BOOL,
                Type::BOOL,
                Type::INT8,
                Type::BYTEA,
            ],
            Stmt::AdvisoryRelease => &[Type::TEXT, Type::BOOL],
            Stmt::AdvisoryQueued | Stmt::Sweep => &[Type::INT4],
            Stmt::Ping => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_matches_the_indices_and_every_parameter_has_a_type() {
        for (i, stmt) in Stmt::ALL.into_iter().enumerate() {
            assert_eq!(stmt.index(), i, "{stmt:?}");
            let sql = stmt.sql("s");
            assert!(!sql.contains("@schema@"), "{stmt:?}");
            let highest = (1..=20)
                .rev()
                .find(|n| sql.contains(&format!("${n}")))
                .unwrap_or(0);
            assert_eq!(highest, stmt.types().len(), "{stmt:?}");
        }
    }
}
