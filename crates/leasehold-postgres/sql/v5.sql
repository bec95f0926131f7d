-- leasehold's PostgreSQL schema, version 5: change feeds (watching locks), both modes.
-- `@schema@` and `@channel@` as in v1.sql; run as v1 is (see src/schema.rs). It redefines
-- functions, so it is run by a role that owns them (the one that made the schema).
--
-- A change feed is a session that listens on the channel `@schema@.feed` and has a row in
-- `watchers` with the prefix it follows. Every grant, release, queued or departed waiter
-- and eviction of a name sends the name on that channel, in its own transaction, but only
-- while some watcher's prefix begins the name: a NOTIFY takes a database-wide lock at
-- commit, which would serialise every committing lock cycle, and wakes every listening
-- session of the database.
--
-- While nobody watches, a lock cycle pays one read of a counter: `watcher_rows`, a sequence
-- whose value is the number of rows in `watchers` (or more), read by a function call
-- (pg_sequence_last_value, what the pg_sequences view reads) rather than a query: a query
-- of the empty table cost 1.7 - 2 times as much (docs/backends/postgres.md, Watching
-- locks). Only when it is above 0 is the table looked at (tell, below). Reading the
-- counter locks the sequence (RowExclusiveLock) until the reader commits; a watcher's start
-- (watch) locks it against them (ALTER SEQUENCE: ShareRowExclusiveLock), which waits for
-- every transaction that read the counter before and has not committed, and keeps those
-- that read it next waiting until the start has committed. So once a watcher's start has
-- committed, every change of a name under its prefix either committed before (a read after
-- the start sees it) or sends it a message.
--
-- The functions below are those of v1, v2 and v4 with that message added; the rest of each
-- is unchanged (tokens, owner checks, fencing, v4's session-start cache and settings). Each
-- reads the counter at its very end, after the last statement that may wait for a row, so
-- that a watcher's start waits only for commits.

-- One row per watching session, named as advisory rows are (its server process and the
-- session's start), with the prefix of the names it follows ('' for all). A row is current
-- while its session lives; rows of gone sessions are dropped by the next watcher's start
-- or end, and by the sweep, and until then only cost the cycles of their names a message
-- nobody reads. Readable by every role that may lock (the lock functions look at it as
-- their caller); written by watch only.
CREATE TABLE @schema@.watchers (
    pid integer NOT NULL,
    started timestamptz NOT NULL,
    prefix text NOT NULL,
    PRIMARY KEY (pid, started)
);
GRANT SELECT ON @schema@.watchers TO PUBLIC;

-- How many rows `watchers` has, or more (never fewer): set by watch only, while it holds
-- the sequence against every reader. 0: nobody watches.
CREATE SEQUENCE @schema@.watcher_rows MINVALUE 0;
SELECT setval('@schema@.watcher_rows', 0, true);
GRANT SELECT ON SEQUENCE @schema@.watcher_rows TO PUBLIC;

-- Tells the watchers of the name that it changed: a message on the feed channel, if a
-- watcher's prefix begins the name. Whether it sent one. The lock functions call it only
-- when the counter is above 0; statements of the client that change a name (a kept grant,
-- an advisory waiter queued or gone) call it as they are. It reads the counter first, so
-- that a watcher's start waits for its commit.
CREATE FUNCTION @schema@.tell(p_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
        PERFORM pg_notify('@schema@.feed', p_name)
        FROM @schema@.watchers w WHERE starts_with(p_name, w.prefix) LIMIT 1;
        RETURN FOUND;
    END IF;
    RETURN false;
END $$;

-- Makes this session a watcher of the names under p_prefix (the caller LISTENs in the same
-- transaction), or with NULL ends its watching; either way it drops the rows of gone
-- watchers and sets the counter. The lock on the sequence waits for the transactions that
-- read the counter and have not committed (see above): bounded by lock_timeout, since each
-- of them reads it after its last wait, and only commits remain. It runs as the schema's
-- owner, who alone may ALTER the sequence: a role other than the owner needs EXECUTE on it
-- to watch (GRANT EXECUTE ON FUNCTION <schema>.watch(text) TO ...).
CREATE FUNCTION @schema@.watch(p_prefix text) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
BEGIN
    -- Changes nothing (no rewrite, unlike most options): only the lock is wanted.
    ALTER SEQUENCE @schema@.watcher_rows OWNED BY NONE;
    -- A session whose start this role may not see (another role's) is kept.
    DELETE FROM @schema@.watchers w
    WHERE w.pid = pg_backend_pid()
       OR NOT EXISTS (SELECT 1 FROM pg_stat_activity s
                      WHERE s.pid = w.pid
                        AND (s.backend_start IS NULL OR s.backend_start = w.started));
    IF p_prefix IS NOT NULL THEN
        INSERT INTO @schema@.watchers (pid, started, prefix)
        VALUES (pg_backend_pid(), @schema@.advisory_session(), p_prefix);
    END IF;
    -- Not rolled back with the transaction: a start that fails after it leaves the counter
    -- too high, which costs a look at the table until the next start, end or sweep.
    PERFORM setval('@schema@.watcher_rows', (SELECT count(*) FROM @schema@.watchers), true);
END $$;
REVOKE ALL ON FUNCTION @schema@.watch(text) FROM PUBLIC;

-- Lease mode ---------------------------------------------------------------------------

-- As in v1, and a grant or a new waiter tells the watchers.
CREATE OR REPLACE FUNCTION @schema@.acquire(
    p_name text, p_owner text, p_mode "char", p_limit integer, p_ttl_ms bigint,
    p_fair boolean, p_waiting boolean, p_delay_ms bigint, p_value bytea,
    OUT o_token bigint, OUT o_retry_ms bigint, OUT o_waited_ms bigint, OUT o_blocked boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_permit boolean := p_mode = 'p';
    v_ttl interval := p_ttl_ms * interval '1 millisecond';
    v_now timestamptz;
    v_closed timestamptz;
    v_me @schema@.waiters;
    v_ok boolean;
    v_held bigint;
    v_next timestamptz;
BEGIN
    o_blocked := false;
    IF @schema@.lock_name(p_name) THEN
        -- A name nobody holds, waits for or delays: the fast path.
        o_token := nextval('@schema@.tokens');
        INSERT INTO @schema@.grants (name, owner, mode, permit_limit, token, expires, lock_delay, value)
        VALUES (p_name, p_owner, p_mode, p_limit, o_token, clock_timestamp() + v_ttl,
                CASE WHEN p_delay_ms > 0 THEN p_delay_ms * interval '1 millisecond' END,
                p_value);
        IF p_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
        IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
            PERFORM @schema@.tell(p_name);
        END IF;
        RETURN;
    END IF;
    -- Read after the name's row is ours: a wait for it does not age the lease.
    v_now := clock_timestamp();
    -- An expired grant left by prune counts as a holder below: the next grant waits for
    -- the fenced write that holds it.
    o_blocked := NOT @schema@.prune(p_name, v_now);

    UPDATE @schema@.grants g SET expires = v_now + v_ttl
    WHERE g.name = p_name AND g.owner = p_owner AND g.expires > v_now
    RETURNING g.token INTO o_token;
    IF FOUND THEN o_blocked := false; RETURN; END IF;

    SELECT CASE WHEN v_permit THEN n.permit_closed_until ELSE n.lock_closed_until END
    INTO v_closed FROM @schema@.names n WHERE n.name = p_name;
    SELECT * INTO v_me FROM @schema@.waiters w WHERE w.name = p_name AND w.owner = p_owner;

    IF v_closed > v_now THEN
        v_ok := false;
    ELSIF v_permit THEN
        -- Each permit with its own limit; granted before the waiters ahead claim their
        -- places only if each of them still fits after it (the contract's rule).
        SELECT count(*) INTO v_held FROM @schema@.grants g WHERE g.name = p_name AND g.mode = 'p';
        SELECT v_held + count(*) < least(p_limit, coalesce(min(w.permit_limit), p_limit))
        INTO v_ok
        FROM @schema@.waiters w
        WHERE p_fair AND w.name = p_name AND w.mode = 'p' AND w.fair
          AND w.owner <> p_owner AND (v_me.seq IS NULL OR w.seq < v_me.seq);
    ELSIF p_mode = 'x' THEN
        v_ok := NOT EXISTS (SELECT 1 FROM @schema@.grants g
                            WHERE g.name = p_name AND g.mode <> 'p')
            AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w
                            WHERE p_fair AND w.name = p_name AND w.mode <> 'p' AND w.fair
                              AND w.owner <> p_owner
                              AND (v_me.seq IS NULL OR w.seq < v_me.seq));
    ELSE
        -- A waiting writer keeps new readers out, queued or not: writers do not starve.
        v_ok := NOT EXISTS (SELECT 1 FROM @schema@.grants g
                            WHERE g.name = p_name AND g.mode = 'x')
            AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w
                            WHERE w.name = p_name AND w.mode = 'x' AND w.owner <> p_owner
                              AND (NOT p_fair OR NOT w.fair OR v_me.seq IS NULL
                                   OR w.seq < v_me.seq));
    END IF;
    -- The owner's own expired grant, still held by a fenced write, is not taken again.
    IF v_ok AND o_blocked THEN
        v_ok := NOT EXISTS (SELECT 1 FROM @schema@.grants g
                            WHERE g.name = p_name AND g.owner = p_owner);
    END IF;

    IF v_ok THEN
        o_blocked := false;
        -- Drawn while the name's row is ours: tokens of a name increase in grant order.
        o_token := nextval('@schema@.tokens');
        INSERT INTO @schema@.grants (name, owner, mode, permit_limit, token, expires, lock_delay, value)
        VALUES (p_name, p_owner, p_mode, p_limit, o_token, v_now + v_ttl,
                CASE WHEN p_delay_ms > 0 THEN p_delay_ms * interval '1 millisecond' END,
                p_value);
        IF v_me.owner IS NOT NULL THEN
            DELETE FROM @schema@.waiters w WHERE w.name = p_name AND w.owner = p_owner;
            -- Readers and permits go in groups: the next in the queue may follow.
            IF p_mode <> 'x' THEN PERFORM @schema@.wake(p_name, v_permit); END IF;
        END IF;
        IF p_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
        IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
            PERFORM @schema@.tell(p_name);
        END IF;
        RETURN;
    END IF;

    IF p_waiting THEN
        IF v_me.owner IS NULL THEN
            INSERT INTO @schema@.waiters (name, owner, mode, permit_limit, fair, seq, since, expires)
            VALUES (p_name, p_owner, p_mode, p_limit, p_fair, nextval('@schema@.queue'),
                    v_now, v_now + v_ttl);
            o_waited_ms := 0;
        ELSE
            UPDATE @schema@.waiters w SET expires = v_now + v_ttl
            WHERE w.name = p_name AND w.owner = p_owner;
            o_waited_ms := floor(extract(epoch FROM v_now - v_me.since) * 1000);
        END IF;
    END IF;
    SELECT min(g.expires) INTO v_next FROM @schema@.grants g
    WHERE g.name = p_name AND (g.mode = 'p') = v_permit AND g.expires > v_now;
    v_next := least(v_next, (SELECT min(w.expires) FROM @schema@.waiters w
                             WHERE w.name = p_name AND w.owner <> p_owner
                               AND (w.mode = 'p') = v_permit));
    IF v_closed > v_now THEN v_next := least(v_next, v_closed); END IF;
    IF v_next IS NOT NULL THEN
        o_retry_ms := greatest(1, ceil(extract(epoch FROM v_next - v_now) * 1000));
    END IF;
    -- A new place in the queue.
    IF p_waiting AND v_me.owner IS NULL THEN
        IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
            PERFORM @schema@.tell(p_name);
        END IF;
    END IF;
END $$;

-- As in v1, and a removed grant or queue entry tells the watchers.
CREATE OR REPLACE FUNCTION @schema@.release(p_name text, p_owner text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz;
    v_name @schema@.names;
    v_grant @schema@.grants;
    v_waiter @schema@.waiters;
    v_found boolean;
BEGIN
    SELECT * INTO v_name FROM @schema@.names n WHERE n.name = p_name FOR UPDATE;
    IF NOT FOUND THEN RETURN false; END IF;
    v_now := clock_timestamp();
    DELETE FROM @schema@.grants g
    WHERE g.name = p_name
      AND g.owner IN (SELECT e.owner FROM @schema@.grants e
                      WHERE e.name = p_name AND e.owner = p_owner
                      FOR UPDATE SKIP LOCKED)
    RETURNING * INTO v_grant;
    v_found := FOUND;
    IF NOT v_found THEN
        -- Held by a fenced write: ended, not removed (a lease cut short has no lock-delay).
        UPDATE @schema@.grants g SET expires = least(g.expires, v_now),
            lock_delay = CASE WHEN g.expires <= v_now THEN g.lock_delay END
        WHERE g.name = p_name AND g.owner = p_owner
        RETURNING * INTO v_grant;
        v_found := FOUND;
        -- Whoever waits looks again, and polls until the write has ended.
        IF v_found THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    END IF;
    IF v_found THEN
        -- A lease that ran out before its release still closes the lock for its delay.
        IF v_grant.expires <= v_now AND v_grant.lock_delay IS NOT NULL THEN
            UPDATE @schema@.names n SET
                lock_closed_until = CASE WHEN v_grant.mode = 'p' THEN n.lock_closed_until
                    ELSE greatest(n.lock_closed_until, v_grant.expires + v_grant.lock_delay) END,
                permit_closed_until = CASE WHEN v_grant.mode <> 'p' THEN n.permit_closed_until
                    ELSE greatest(n.permit_closed_until, v_grant.expires + v_grant.lock_delay) END
            WHERE n.name = p_name
            RETURNING * INTO v_name;
        END IF;
    ELSE
        DELETE FROM @schema@.waiters w WHERE w.name = p_name AND w.owner = p_owner
        RETURNING * INTO v_waiter;
        v_found := FOUND;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM @schema@.grants g WHERE g.name = p_name)
       AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w WHERE w.name = p_name) THEN
        -- Nothing left under the name: its row goes too, unless a lock-delay runs.
        IF coalesce(v_name.lock_closed_until, '-infinity') <= v_now
           AND coalesce(v_name.permit_closed_until, '-infinity') <= v_now THEN
            DELETE FROM @schema@.names n WHERE n.name = p_name;
        END IF;
        IF v_grant.value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
        IF v_found THEN
            IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
                PERFORM @schema@.tell(p_name);
            END IF;
        END IF;
        RETURN v_found;
    END IF;
    PERFORM @schema@.prune(p_name, v_now);
    IF v_found THEN
        PERFORM @schema@.wake(p_name, coalesce(v_grant.mode, v_waiter.mode) = 'p');
        IF v_grant.value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    END IF;
    -- What was left may have expired.
    DELETE FROM @schema@.names n
    WHERE n.name = p_name
      AND NOT EXISTS (SELECT 1 FROM @schema@.grants g WHERE g.name = p_name)
      AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w WHERE w.name = p_name)
      AND coalesce(n.lock_closed_until, '-infinity') <= v_now
      AND coalesce(n.permit_closed_until, '-infinity') <= v_now;
    IF v_found THEN
        IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
            PERFORM @schema@.tell(p_name);
        END IF;
    END IF;
    RETURN v_found;
END $$;

-- As in v2, and an eviction tells the watchers.
CREATE OR REPLACE FUNCTION @schema@.evict(
    p_name text, p_owner text, p_mode "char", p_token bigint,
    p_by text, p_reason text, p_at_ms bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_permit boolean := p_mode = 'p';
    v_now timestamptz;
    v_grant @schema@.grants;
BEGIN
    PERFORM 1 FROM @schema@.names n WHERE n.name = p_name FOR UPDATE;
    IF NOT FOUND THEN RETURN false; END IF;
    -- Locked against a renewal (which does not lock the name's row), so that its lease is
    -- read as it ends here; a fenced write's KEY SHARE lock does not stop this one.
    SELECT * INTO v_grant FROM @schema@.grants g
    WHERE g.name = p_name AND g.owner = p_owner AND g.token = p_token
      AND (g.mode = 'p') = v_permit
    FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN false; END IF;
    v_now := clock_timestamp();
    IF v_grant.expires <= v_now THEN RETURN false; END IF;
    DELETE FROM @schema@.grants g
    WHERE g.name = p_name
      AND g.owner IN (SELECT e.owner FROM @schema@.grants e
                      WHERE e.name = p_name AND e.owner = p_owner
                      FOR UPDATE SKIP LOCKED);
    IF NOT FOUND THEN
        -- Held by a fenced write: ended, not removed. No lock-delay: the closure below
        -- covers what was left of the lease and the lock-delay after it.
        UPDATE @schema@.grants g SET expires = v_now, lock_delay = NULL
        WHERE g.name = p_name AND g.owner = p_owner;
    END IF;
    UPDATE @schema@.names n SET
        lock_closed_until = CASE WHEN v_permit THEN n.lock_closed_until
            ELSE greatest(n.lock_closed_until,
                          v_grant.expires + coalesce(v_grant.lock_delay, interval '0')) END,
        permit_closed_until = CASE WHEN v_permit
            THEN greatest(n.permit_closed_until,
                          v_grant.expires + coalesce(v_grant.lock_delay, interval '0'))
            ELSE n.permit_closed_until END
    WHERE n.name = p_name;
    INSERT INTO @schema@.evictions (name, owner, token, evicted_by, reason, at_ms)
    VALUES (p_name, p_owner, p_token, p_by, p_reason, p_at_ms);
    DELETE FROM @schema@.evictions e
    WHERE e.name = p_name
      AND e.seq NOT IN (SELECT k.seq FROM @schema@.evictions k WHERE k.name = p_name
                        ORDER BY k.seq DESC LIMIT 10);
    -- Waiters look again (and learn when the closure ends); so do observers.
    PERFORM pg_notify('@channel@', p_name || ' *');
    IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
        PERFORM @schema@.tell(p_name);
    END IF;
    RETURN true;
END $$;

-- As in v1, and at the end it tells the watchers of the names whose advisory rows it
-- dropped — a session that ended without a release (terminated, timed out, its client
-- gone) freed its lock then, which nothing else told — and, while the counter says someone
-- watches, drops the rows of gone watchers (through watch, which sets the counter again:
-- where this role may call it).
CREATE OR REPLACE FUNCTION @schema@.sweep(p_limit integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_name text;
    v_swept integer := 0;
    v_told bigint;
BEGIN
    FOR v_name IN
        SELECT n.name FROM @schema@.names n
        WHERE NOT EXISTS (SELECT 1 FROM @schema@.grants g
                          WHERE g.name = n.name AND g.expires > v_now)
          AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w
                          WHERE w.name = n.name AND w.expires > v_now)
          AND coalesce(n.lock_closed_until, '-infinity') <= v_now
          AND coalesce(n.permit_closed_until, '-infinity') <= v_now
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    LOOP
        -- An expired grant with a lock-delay closes the name now: kept for a later sweep.
        PERFORM @schema@.prune(v_name, v_now);
        DELETE FROM @schema@.names n
        WHERE n.name = v_name
          AND NOT EXISTS (SELECT 1 FROM @schema@.grants g WHERE g.name = v_name)
          AND NOT EXISTS (SELECT 1 FROM @schema@.waiters w WHERE w.name = v_name)
          AND coalesce(n.lock_closed_until, '-infinity') <= v_now
          AND coalesce(n.permit_closed_until, '-infinity') <= v_now;
        IF FOUND THEN v_swept := v_swept + 1; END IF;
    END LOOP;
    -- A session this role may not see the start of (another role's) is kept.
    WITH gone AS (
        DELETE FROM @schema@.advisory a
        WHERE (a.pid, a.started) IN (
            SELECT e.pid, e.started FROM @schema@.advisory e
            WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity s
                              WHERE s.pid = e.pid
                                AND (s.backend_start IS NULL OR s.backend_start = e.started))
            FOR UPDATE SKIP LOCKED)
        RETURNING a.name)
    SELECT count(pg_notify('@schema@.feed', g.name)) INTO v_told
    FROM (SELECT DISTINCT gone.name FROM gone) g
    WHERE EXISTS (SELECT 1 FROM @schema@.watchers w WHERE starts_with(g.name, w.prefix));
    -- Last, so that the lock watch takes on the counter (every grant reads it) is held
    -- only until this statement commits, not through the sweep. Until here this holds no
    -- lock on the counter: watch waits for the counter's readers. Read as a table,
    -- the sequence is not locked against watch (AccessShareLock).
    IF (SELECT c.last_value FROM @schema@.watcher_rows c) > 0
       AND has_function_privilege('@schema@.watch(text)', 'EXECUTE')
       AND ((SELECT c.last_value FROM @schema@.watcher_rows c)
                > (SELECT count(*) FROM @schema@.watchers)
            OR EXISTS (SELECT 1 FROM @schema@.watchers w
                       WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity s
                                         WHERE s.pid = w.pid
                                           AND (s.backend_start IS NULL
                                                OR s.backend_start = w.started)))) THEN
        BEGIN
            PERFORM @schema@.watch(NULL);
        EXCEPTION WHEN lock_not_available THEN
            -- Watchers starting or ending meanwhile: left for the next sweep.
        END;
    END IF;
    RETURN v_swept;
END $$;

-- Advisory mode ------------------------------------------------------------------------

-- As in v4 (its settings too), and the grant tells the watchers, once the lock is taken:
-- a waiting grant reads the counter only after its wait. A holder whose session ended
-- without a release left its row; the grant that follows removes it, and its message
-- tells the watchers of both changes.
CREATE OR REPLACE FUNCTION @schema@.advisory_acquire(
    p_name text, p_owner text, p_shared boolean, p_wait boolean, p_ttl_ms bigint, p_value bytea)
RETURNS bigint
LANGUAGE plpgsql
SET enable_bitmapscan = off
AS $$
DECLARE
    v_key bigint := @schema@.advisory_key(p_name);
    v_token bigint;
BEGIN
    PERFORM set_config('idle_session_timeout', p_ttl_ms || 'ms', false);
    IF p_wait THEN
        -- Shown in pg_stat_activity: who waits, for inspect.
        PERFORM set_config('application_name', 'leasehold ' || p_owner, false);
        IF p_shared THEN
            PERFORM pg_advisory_lock_shared(v_key);
        ELSE
            PERFORM pg_advisory_lock(v_key);
        END IF;
    ELSIF NOT (CASE WHEN p_shared THEN pg_try_advisory_lock_shared(v_key)
                    ELSE pg_try_advisory_lock(v_key) END) THEN
        RETURN NULL;
    END IF;
    v_token := nextval('@schema@.tokens');
    -- Any earlier row under this process id is stale (this session's, or a gone session's
    -- whose id was handed out again), and so are the rows of holders this grant excludes.
    -- They are removed, never updated: a fenced write holding one (see holds) makes this
    -- wait for its commit.
    PERFORM 1 FROM @schema@.advisory a
    WHERE (a.pid, a.started) IN (
        SELECT e.pid, e.started FROM @schema@.advisory e WHERE e.pid = pg_backend_pid()
        UNION ALL
        SELECT e.pid, e.started FROM @schema@.advisory e
        WHERE e.name = p_name AND (NOT p_shared OR e.mode = 'x'))
    ORDER BY a.pid, a.started
    FOR UPDATE OF a;
    DELETE FROM @schema@.advisory a WHERE a.pid = pg_backend_pid();
    DELETE FROM @schema@.advisory a WHERE a.name = p_name AND (NOT p_shared OR a.mode = 'x');
    INSERT INTO @schema@.advisory (pid, started, name, owner, mode, token, session_ttl_ms, value)
    VALUES (pg_backend_pid(), @schema@.advisory_session(), p_name, p_owner,
            CASE WHEN p_shared THEN 's' ELSE 'x' END, v_token, p_ttl_ms, p_value);
    IF p_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
        PERFORM @schema@.tell(p_name);
    END IF;
    RETURN v_token;
END $$;

-- As in v4 (its settings too), and the release tells the watchers.
CREATE OR REPLACE FUNCTION @schema@.advisory_release(p_name text, p_shared boolean)
RETURNS boolean
LANGUAGE plpgsql
SET enable_bitmapscan = off
SET client_min_messages = error
AS $$
DECLARE
    v_key bigint := @schema@.advisory_key(p_name);
    v_held boolean;
    v_value bytea;
BEGIN
    v_held := CASE WHEN p_shared THEN pg_advisory_unlock_shared(v_key)
                   ELSE pg_advisory_unlock(v_key) END;
    PERFORM pg_advisory_unlock_all();
    SELECT a.value INTO v_value FROM @schema@.advisory a
    WHERE a.pid = pg_backend_pid() AND a.name = p_name;
    DELETE FROM @schema@.advisory a
    WHERE (a.pid, a.started) IN (SELECT e.pid, e.started FROM @schema@.advisory e
                                 WHERE e.pid = pg_backend_pid() FOR UPDATE SKIP LOCKED);
    RESET idle_session_timeout;
    IF current_setting('application_name') LIKE 'leasehold %' THEN
        RESET application_name;
    END IF;
    IF v_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    IF pg_sequence_last_value('@schema@.watcher_rows'::regclass) > 0 THEN
        PERFORM @schema@.tell(p_name);
    END IF;
    RETURN v_held;
END $$;
