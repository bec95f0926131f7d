//! Every statement the backend sends, defined once.
//! Its SQL (with the schema written in) and the types of its parameters.
//!
//! On a connection of its own a statement is prepared once and then sent as Bind/Execute:
//! one round trip. Through a transaction-pooling proxy, where a prepared statement may be
//! gone by the next transaction, the same text is sent with its types each time (Parse,
//! Bind, Execute in one message batch — one round trip too).

use tokio_postgres::types::Type;

/// Lease mode's live grants, queued waiters and last 10 evictions of one name.
/// The name `$name` is an SQL expression. Holders, then waiters, then evictions newest first when ordered by
/// `holder DESC, evicted, permit, unfair, ord`; inspect and list read them alike (see
/// `reply::lease_entry`). A grant past its expiry is not a holder, even while a fenced write
/// keeps its row.
macro_rules! lease_state {
    ($name:literal) => {
        concat!(
            "SELECT true AS holder, g.owner, g.mode::text, g.permit_limit, g.token, \
                    greatest(0, ceil(extract(epoch FROM g.expires - clock_timestamp()) * 1000))::bigint, \
                    g.value, g.mode = 'p' AS permit, 0 AS unfair, g.token AS ord, \
                    false AS evicted, NULL AS evicted_by, NULL AS reason, NULL::bigint AS at_ms \
             FROM @schema@.grants g WHERE g.name = ",
            $name,
            " AND g.expires > clock_timestamp() \
             UNION ALL \
             SELECT false, w.owner, w.mode::text, w.permit_limit, NULL, NULL, NULL, \
                    w.mode = 'p', CASE WHEN w.fair THEN 0 ELSE 1 END, w.seq, \
                    false, NULL, NULL, NULL \
             FROM @schema@.waiters w WHERE w.name = ",
            $name,
            " AND w.expires > clock_timestamp() \
             UNION ALL \
             (SELECT false, e.owner, NULL, NULL, e.token, NULL, NULL, false, 0, -e.seq, \
                     true, e.evicted_by, e.reason, e.at_ms \
              FROM @schema@.evictions e WHERE e.name = ",
            $name,
            " ORDER BY e.seq DESC LIMIT 10)"
        )
    };
}

/// Advisory mode's holders and waiters of the names of `$keys`.
/// `$keys` is a FROM item `k` with the columns `name` and `key` (its advisory key). A holder
/// is a session holding the key whose row of the name is current; a waiter, any session
/// queued for the key (its owner from its `application_name`). Inspect and list read them
/// alike (see `reply::advisory_entry`).
macro_rules! advisory_state {
    ($keys:literal) => {
        concat!(
            "SELECT l.granted, CASE WHEN l.granted THEN a.owner \
                        ELSE substr(s.application_name, 11) END AS owner, \
                    CASE WHEN l.mode = 'ShareLock' THEN 's' ELSE 'x' END AS mode, \
                    a.token, \
                    CASE WHEN s.state = 'idle' THEN greatest(0, a.session_ttl_ms \
                         - floor(extract(epoch FROM clock_timestamp() - s.state_change) * 1000))::bigint \
                         ELSE a.session_ttl_ms END AS remaining, \
                    a.value, k.name, l.waitstart \
             FROM ",
            $keys,
            " JOIN pg_locks l ON ((l.classid::bigint << 32) | l.objid::bigint) = k.key \
             LEFT JOIN pg_stat_activity s ON s.pid = l.pid \
             LEFT JOIN @schema@.advisory a ON a.pid = l.pid AND a.name = k.name \
                  AND (s.backend_start IS NULL OR a.started = s.backend_start) \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 \
               AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) \
               AND (NOT l.granted OR a.token IS NOT NULL)"
        )
    };
}

/// A record's upsert that runs only if the writer's grant `$live` (a FROM item) has a row.
/// The record is `$5` under `$4` beside the name `$1`, kept `$6` ms. One row, whether it
/// wrote. The name's other expired records go too, those no other
/// statement has locked (two writers of a name never wait for each other's rows).
macro_rules! put_record {
    ($live:literal) => {
        concat!(
            "WITH live AS (",
            $live,
            "), \
             swept AS ( \
                 DELETE FROM @schema@.records r WHERE (r.name, r.key) IN ( \
                     SELECT e.name, e.key FROM @schema@.records e \
                     WHERE e.name = $1 AND e.key <> $4 AND e.expires_at <= clock_timestamp() \
                     FOR UPDATE SKIP LOCKED)), \
             written AS ( \
                 INSERT INTO @schema@.records (name, key, value, expires_at) \
                 SELECT $1, $4, $5, clock_timestamp() + $6 * interval '1 millisecond' \
                 WHERE EXISTS (SELECT 1 FROM live) \
                 ON CONFLICT (name, key) DO UPDATE \
                 SET value = excluded.value, expires_at = excluded.expires_at \
                 RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM written)"
        )
    };
}

/// A statement of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stmt {
    /// Lease mode: grant or busy (see `acquire` in `sql/v1.sql`).
    Acquire,
    /// Lease mode: owner-checked extension of a live lease; answers one row or none.
    Renew,
    /// Lease mode: [`Renew`](Stmt::Renew) for many grants at once.
    /// Its parameters are arrays (names, owners, leases in ms), one element per grant; it
    /// answers the place (from 1) of each grant it extended.
    RenewMany,
    /// Lease mode: owner-checked removal of a grant or queue entry.
    Release,
    /// Lease mode: holders, waiters and evictions of a name.
    Inspect,
    /// Both modes: drop what vanished holders left behind, and what has expired.
    /// That is records past their keep, and evictions over a week old.
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
    /// If it does, the watchers of the name it waits for are told (a new waiter).
    AdvisoryQueued,
    /// The server process of this connection.
    Ping,
    /// Lease mode: a page of the names under a prefix, each with its holders and waiters.
    List,
    /// Advisory mode: a page of the names under a prefix, each with its holders and waiters.
    AdvisoryList,
    /// Whether both modes' name columns sort by code point.
    /// Then the names under a prefix are one range of their index (see `listing.rs`).
    CodePointOrder,
    /// Lease mode: force-release of one grant, recorded (see `evict` in `sql/v2.sql`).
    Evict,
    /// Lease mode: whether an owner whose grant is gone was evicted.
    Evicted,
    /// Lease mode: a record beside a name, written only while the writer's lease is live.
    PutRecord,
    /// Advisory mode: a record beside a name, written only while this session holds it.
    /// That is the writer's lock, checked in `pg_locks`.
    AdvisoryPutRecord,
    /// Both modes: a record beside a name, unless it has expired.
    GetRecord,
    /// Lease mode: a last owner-checked extension of a live lease, waking the waiters.
    /// Its end may come sooner than they were told; one row or none. The watchers of the
    /// name are told too (the grant is kept now).
    Keep,
    /// Both modes: tells the watchers of a name that it changed, if any follows it.
    /// That is for a change no statement of the schema makes (an advisory waiter that
    /// gave up: its cancelled wait ends nothing that commits).
    TellWatchers,
    /// This connection's server session: its process id and when it started.
    /// The two name one session (a process id is used again once its process is gone).
    Session,
    /// Ends the session of process `$1` started at `$2`, waiting up to `$3` ms for it to end.
    /// Answers whether it has ended (true if it was gone already).
    EndSession,
}

impl Stmt {
    /// Every statement: those a connection prepares first, then those sent with their text.
    pub(crate) const ALL: [Stmt; 24] = [
        Stmt::Acquire,
        Stmt::Renew,
        Stmt::RenewMany,
        Stmt::Release,
        Stmt::Inspect,
        Stmt::Sweep,
        Stmt::AdvisoryAcquire,
        Stmt::AdvisoryHeld,
        Stmt::AdvisoryRelease,
        Stmt::AdvisoryInspect,
        Stmt::AdvisoryQueued,
        Stmt::Ping,
        Stmt::List,
        Stmt::AdvisoryList,
        Stmt::CodePointOrder,
        Stmt::Evict,
        Stmt::Evicted,
        Stmt::PutRecord,
        Stmt::AdvisoryPutRecord,
        Stmt::GetRecord,
        Stmt::Keep,
        Stmt::TellWatchers,
        Stmt::Session,
        Stmt::EndSession,
    ];

    /// Whether a connection prepares it when it opens.
    /// Listings are rare: they are sent with their text each time, which keeps them from
    /// slowing down every connection's start (advisory mode opens one per held lock), and
    /// has the server plan each with its values, which turns `$3 IS NULL OR name < $3`
    /// into an index bound or nothing. Evictions, and the look for one after a renewal found
    /// no grant, are rarer still; records are written and read about once per job run; a
    /// waiter that gives up in advisory mode tells the watchers itself. A connection asks
    /// for its session once, and ends another's only when it replaces it.
    pub(crate) fn prepared(self) -> bool {
        !matches!(
            self,
            Stmt::List
                | Stmt::AdvisoryList
                | Stmt::CodePointOrder
                | Stmt::Evict
                | Stmt::Evicted
                | Stmt::PutRecord
                | Stmt::AdvisoryPutRecord
                | Stmt::GetRecord
                | Stmt::Keep
                | Stmt::TellWatchers
                | Stmt::Session
                | Stmt::EndSession
        )
    }

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
            // Renew's condition and new expiry, row by row: each grant's lease measured from
            // when its row is updated. A name and owner given twice are extended once (and
            // answered once): the caller sends each grant once. The arrays are read through
            // subqueries so that the planner does not see their length: told of 512 grants
            // to renew (a statement sent with its text is planned with its values), it
            // would read the whole table into a hash rather than look each one up by the
            // primary key (40 ms rather than 5 with 10⁵ grants).
            Stmt::RenewMany => {
                "UPDATE @schema@.grants g \
                 SET expires = clock_timestamp() + r.ttl * interval '1 millisecond' \
                 FROM unnest((SELECT $1::text[]), (SELECT $2::text[]), (SELECT $3::bigint[])) \
                      WITH ORDINALITY AS r(name, owner, ttl, i) \
                 WHERE g.name = r.name AND g.owner = r.owner AND g.expires > clock_timestamp() \
                 RETURNING r.i"
            }
            Stmt::Keep => {
                "WITH kept AS (UPDATE @schema@.grants \
                 SET expires = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE name = $1 AND owner = $2 AND expires > clock_timestamp() RETURNING name) \
                 SELECT pg_notify('@channel@', k.name || ' *'), @schema@.tell(k.name) FROM kept k"
            }
            Stmt::Release => "SELECT @schema@.release($1, $2)",
            Stmt::Inspect => concat!(
                lease_state!("$1"),
                " ORDER BY holder DESC, evicted, permit, unfair, ord"
            ),
            // Expired records too, up to as many (by their expiry's index), none another
            // statement has locked.
            // Evictions are kept a week, as on Redis: long past any lease they could end.
            Stmt::Sweep => {
                "WITH records AS ( \
                     DELETE FROM @schema@.records r WHERE (r.name, r.key) IN ( \
                         SELECT e.name, e.key FROM @schema@.records e \
                         WHERE e.expires_at <= clock_timestamp() \
                         LIMIT $1 FOR UPDATE SKIP LOCKED)), \
                 evictions AS ( \
                     DELETE FROM @schema@.evictions v WHERE (v.name, v.seq) IN ( \
                         SELECT o.name, o.seq FROM @schema@.evictions o \
                         WHERE o.at_ms < (extract(epoch FROM clock_timestamp()) * 1000)::bigint \
                             - 7 * 24 * 3600 * 1000 \
                         LIMIT $1 FOR UPDATE SKIP LOCKED)) \
                 SELECT @schema@.sweep($1)"
            }
            Stmt::AdvisoryAcquire => "SELECT @schema@.advisory_acquire($1, $2, $3, $4, $5, $6)",
            Stmt::AdvisoryHeld => "SELECT @schema@.advisory_held($1)",
            Stmt::AdvisoryRelease => "SELECT @schema@.advisory_release($1, $2)",
            Stmt::AdvisoryInspect => concat!(
                advisory_state!("(SELECT $1::text AS name, @schema@.advisory_key($1) AS key) k"),
                " ORDER BY l.granted DESC, a.token, l.waitstart"
            ),
            Stmt::AdvisoryQueued => {
                "SELECT q.queued, CASE WHEN q.queued THEN @schema@.tell($2) END \
                 FROM (SELECT EXISTS (SELECT 1 FROM pg_locks l \
                     WHERE l.pid = $1 AND l.locktype = 'advisory' AND NOT l.granted) AS queued) q"
            }
            Stmt::Ping => "SELECT pg_backend_pid()",
            Stmt::List => concat!(
                "WITH page AS ( \
                     SELECT n.name FROM @schema@.names n \
                     WHERE n.name >= $2 AND ($3::text IS NULL OR n.name < $3) AND n.name > $4 \
                     ORDER BY n.name LIMIT $5) \
                 SELECT s.*, p.name FROM page p \
                 LEFT JOIN LATERAL (",
                lease_state!("p.name"),
                ") s ON starts_with(p.name, $1) \
                 ORDER BY p.name, s.holder DESC, s.evicted, s.permit, s.unfair, s.ord"
            ),
            Stmt::AdvisoryList => concat!(
                "WITH page AS ( \
                     SELECT DISTINCT a.name FROM @schema@.advisory a \
                     WHERE a.name >= $2 AND ($3::text IS NULL OR a.name < $3) AND a.name > $4 \
                     ORDER BY a.name LIMIT $5), \
                 keys AS MATERIALIZED ( \
                     SELECT p.name, @schema@.advisory_key(p.name) AS key FROM page p \
                     WHERE starts_with(p.name, $1)), \
                 state AS (",
                advisory_state!("keys k"),
                ") \
                 SELECT s.granted, s.owner, s.mode, s.token, s.remaining, s.value, p.name \
                 FROM page p LEFT JOIN state s ON s.name = p.name \
                 ORDER BY p.name, s.granted DESC, s.token, s.waitstart"
            ),
            Stmt::CodePointOrder => {
                "SELECT count(*) = 2 AND coalesce(bool_and(o.provider = 'b' \
                            OR (o.provider = 'c' AND lower(o.lc) IN ('c', 'posix', 'c.utf8', 'c.utf-8'))), \
                        false) \
                 FROM pg_attribute a \
                 JOIN pg_collation c ON c.oid = a.attcollation \
                 JOIN pg_database d ON d.datname = current_database() \
                 CROSS JOIN LATERAL (SELECT \
                     CASE WHEN c.collprovider = 'd' \
                          THEN coalesce(to_jsonb(d) ->> 'datlocprovider', 'c') \
                          ELSE c.collprovider::text END AS provider, \
                     CASE WHEN c.collprovider = 'd' THEN d.datcollate::text \
                          ELSE c.collcollate::text END AS lc) o \
                 WHERE a.attrelid IN ('@schema@.names'::regclass, '@schema@.advisory'::regclass) \
                   AND a.attname = 'name'"
            }
            Stmt::Evict => "SELECT @schema@.evict($1, $2, $3, $4, $5, $6, $7)",
            Stmt::Evicted => {
                "SELECT EXISTS (SELECT 1 FROM @schema@.evictions e \
                 WHERE e.name = $1 AND e.owner = $2)"
            }
            // The live grant as renew finds it, in the request's set ($3: the permit set),
            // locked as a fenced write locks it (see `holds` in sql/v1.sql): a release or
            // an eviction racing the write ends its lease but leaves its row, which keeps
            // the next grant of the set waiting until this statement has committed.
            Stmt::PutRecord => put_record!(
                "SELECT 1 FROM @schema@.grants g \
                 WHERE g.name = $1 AND g.owner = $2 AND (g.mode = 'p') = $3 \
                   AND g.expires > clock_timestamp() \
                 FOR KEY SHARE"
            ),
            // Sent on the session holding the lock: this session's current row of the
            // name for the owner in mode $3, and the lock in pg_locks (as advisory_held
            // asks). Only this session can give the lock up, and it runs this statement; if
            // the session is ended meanwhile, the statement is rolled back with it.
            Stmt::AdvisoryPutRecord => put_record!(
                "SELECT 1 FROM @schema@.advisory a \
                 WHERE a.pid = pg_backend_pid() AND a.started = @schema@.advisory_session() \
                   AND a.name = $1 AND a.owner = $2 AND a.mode = $3 \
                   AND @schema@.advisory_holds(a.pid, a.started, @schema@.advisory_key($1))"
            ),
            Stmt::GetRecord => {
                "SELECT r.value FROM @schema@.records r \
                 WHERE r.name = $1 AND r.key = $2 AND r.expires_at > clock_timestamp()"
            }
            Stmt::TellWatchers => "SELECT @schema@.tell($1)",
            Stmt::Session => {
                "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            }
            Stmt::EndSession => {
                "SELECT coalesce(bool_and(pg_terminate_backend(pid, $3)), true) \
                 FROM pg_stat_activity WHERE pid = $1 AND backend_start = $2"
            }
        }
    }

    /// The SQL for `schema`.
    pub(crate) fn sql(self, schema: &str) -> String {
        (self.template())
            .replace("@schema@", schema)
            .replace("@channel@", &crate::schema::channel(schema))
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
            Stmt::Renew | Stmt::Keep => &[Type::TEXT, Type::TEXT, Type::INT8],
            Stmt::RenewMany => &[Type::TEXT_ARRAY, Type::TEXT_ARRAY, Type::INT8_ARRAY],
            Stmt::Release | Stmt::Evicted | Stmt::GetRecord => &[Type::TEXT, Type::TEXT],
            Stmt::PutRecord => &[
                Type::TEXT,
                Type::TEXT,
                Type::BOOL,
                Type::TEXT,
                Type::BYTEA,
                Type::INT8,
            ],
            Stmt::AdvisoryPutRecord => &[
                Type::TEXT,
                Type::TEXT,
                Type::CHAR,
                Type::TEXT,
                Type::BYTEA,
                Type::INT8,
            ],
            Stmt::Evict => &[
                Type::TEXT,
                Type::TEXT,
                Type::CHAR,
                Type::INT8,
                Type::TEXT,
                Type::TEXT,
                Type::INT8,
            ],
            Stmt::Inspect | Stmt::AdvisoryHeld | Stmt::AdvisoryInspect | Stmt::TellWatchers => {
                &[Type::TEXT]
            }
            Stmt::AdvisoryAcquire => &[
                Type::TEXT,
                Type::TEXT,
                Type::BOOL,
                Type::BOOL,
                Type::INT8,
                Type::BYTEA,
            ],
            Stmt::AdvisoryRelease => &[Type::TEXT, Type::BOOL],
            Stmt::AdvisoryQueued => &[Type::INT4, Type::TEXT],
            Stmt::Sweep => &[Type::INT4],
            Stmt::Ping | Stmt::CodePointOrder | Stmt::Session => &[],
            Stmt::EndSession => &[Type::INT4, Type::TIMESTAMPTZ, Type::INT8],
            Stmt::List | Stmt::AdvisoryList => {
                &[Type::TEXT, Type::TEXT, Type::TEXT, Type::TEXT, Type::INT8]
            }
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

    #[test]
    fn the_prepared_statements_come_first() {
        let prepared = Stmt::ALL.iter().take_while(|s| s.prepared()).count();
        assert!(Stmt::ALL[prepared..].iter().all(|s| !s.prepared()));
    }
}
