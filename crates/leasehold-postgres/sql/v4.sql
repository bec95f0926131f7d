-- leasehold's PostgreSQL schema, version 4: advisory mode's grant and release without a
-- read of every session's state and without scans over dead rows. `@schema@` and
-- `@channel@` as in v1.sql; run as v1 is (see src/schema.rs). It redefines functions, so
-- it is run by a role that owns them (the one that made the schema).

-- When this session started: read once per session, then kept in the session's setting
-- leasehold.session_start (reading it costs a copy of every session's state, which grows
-- with max_connections). A setting never outlives its process, so a process id handed out
-- again starts without it; RESET ALL or DISCARD ALL (a pooler) clears it, and it is read
-- again. Kept in ISO form at UTC, which reads back the same whatever the session's DateStyle
-- and TimeZone. A wrong value could only make this session's rows look like a gone
-- session's (refused, swept), never another session's rows look like this one's.
CREATE OR REPLACE FUNCTION @schema@.advisory_session() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_started text := current_setting('leasehold.session_start', true);
BEGIN
    IF v_started IS NULL OR v_started = '' THEN
        SELECT to_char(s.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || 'Z'
        INTO v_started
        FROM pg_stat_get_activity(pg_backend_pid()) s;
        PERFORM set_config('leasehold.session_start', v_started, false);
    END IF;
    RETURN v_started::timestamptz;
END $$;

-- As in v1, with the stale rows found by process id and by name apart, and locked in one
-- order before they go. One statement with either condition is a bitmap scan or, without
-- bitmap scans (below), a scan of the whole table; two statements that each lock as they
-- go could deadlock with a grant of another session doing the same the other way round.
--
-- enable_bitmapscan = off: every grant and release leaves a dead row until autovacuum comes
-- (once a minute by default). A bitmap scan visits every one of them on each lookup without
-- marking its index entry dead; a plain index scan marks them, and later scans skip them.
-- With one client, 40 % less server time per cycle (docs/backends/postgres.md, Performance).
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
    RETURN v_token;
END $$;

-- As in v1, but whether the session held the name comes from the unlock itself rather than
-- from pg_locks (a copy of the whole lock table): pg_advisory_unlock answers whether this
-- session held the key in that mode. Unlocking a key the session does not hold (a release
-- sent twice) warns: not the client's business (client_min_messages). Bitmap scans off, as
-- for the grant.
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
    RETURN v_held;
END $$;
