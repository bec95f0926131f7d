-- leasehold's PostgreSQL schema, version 4: advisory mode's grant and release without a
-- read of every session's state and without writing ahead. `@schema@` and `@channel@` as in
-- v1.sql; run as v1 is (see src/schema.rs).

-- An advisory lock ends with its server (a crash, a restart, a failover), so the rows saying
-- who holds one need not outlive it either: the table is not written ahead, and a grant's
-- commit waits for no log flush. After a crash the server empties it, as it has emptied the
-- lock table. Tokens still come from the logged sequence, which never repeats a value.
ALTER TABLE @schema@.advisory SET UNLOGGED;

-- When this session started: read once per session (`pg_stat_get_activity` of this process
-- alone, not the view of every session, whose cost grows with max_connections), then kept in
-- the session's setting leasehold.session_start. A setting never outlives its process, so a
-- process id handed out again starts without it; RESET ALL or DISCARD ALL (a pooler) clears
-- it, and it is read again.
CREATE OR REPLACE FUNCTION @schema@.advisory_session() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_started text := current_setting('leasehold.session_start', true);
BEGIN
    IF v_started IS NULL OR v_started = '' THEN
        SELECT s.backend_start::text INTO v_started
        FROM pg_stat_get_activity(pg_backend_pid()) s;
        PERFORM set_config('leasehold.session_start', v_started, false);
    END IF;
    RETURN v_started::timestamptz;
END $$;

-- As in v1, but whether the session held the name comes from the unlock itself rather than
-- from pg_locks (a copy of the whole lock table): pg_advisory_unlock answers whether this
-- session held the key in that mode.
CREATE OR REPLACE FUNCTION @schema@.advisory_release(p_name text, p_shared boolean)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint := @schema@.advisory_key(p_name);
    v_held boolean;
    v_value bytea;
BEGIN
    -- Unlocking a key the session does not hold warns; a release sent twice is no news.
    PERFORM set_config('client_min_messages', 'error', true);
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

-- As in v1, but the stale rows go in two statements, by process id and by name: one
-- statement with either condition is a bitmap scan or, without bitmap scans (below), a scan
-- of the whole table.
CREATE OR REPLACE FUNCTION @schema@.advisory_acquire(
    p_name text, p_owner text, p_shared boolean, p_wait boolean, p_ttl_ms bigint, p_value bytea)
RETURNS bigint
LANGUAGE plpgsql AS $$
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
    DELETE FROM @schema@.advisory a WHERE a.pid = pg_backend_pid();
    DELETE FROM @schema@.advisory a WHERE a.name = p_name AND (NOT p_shared OR a.mode = 'x');
    INSERT INTO @schema@.advisory (pid, started, name, owner, mode, token, session_ttl_ms, value)
    VALUES (pg_backend_pid(), @schema@.advisory_session(), p_name, p_owner,
            CASE WHEN p_shared THEN 's' ELSE 'x' END, v_token, p_ttl_ms, p_value);
    IF p_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    RETURN v_token;
END $$;

-- Every grant and release leaves a dead row behind until autovacuum comes (once a minute by
-- default). The planner picks bitmap scans for the lookups by pid and by name, and a bitmap
-- scan visits every dead row each time without marking its index entry dead, so the cost
-- of a cycle grew with the rows of the last minute. A plain index scan marks them, and
-- later scans skip them: with one client, 40 % less server time per cycle (see
-- docs/backends/postgres.md, Performance).
ALTER FUNCTION @schema@.advisory_acquire(text, text, boolean, boolean, bigint, bytea)
    SET enable_bitmapscan = off;
ALTER FUNCTION @schema@.advisory_release(text, boolean) SET enable_bitmapscan = off;
