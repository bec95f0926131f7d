-- leasehold's PostgreSQL schema, version 1. `@schema@` is replaced by the schema's name and
-- `@channel@` by the channel wake-ups are sent on. Run once per schema, in a transaction
-- that holds the schema's migration lock (see src/schema.rs).

-- Fencing tokens of every grant, both modes. A sequence never hands out a value twice, even
-- across a crash: it is logged ahead of use.
CREATE SEQUENCE @schema@.tokens;
-- Places in the FIFO queues.
CREATE SEQUENCE @schema@.queue;

-- Lease mode ---------------------------------------------------------------------------

-- One row per name in use: the row every grant, release and queue change of the name locks
-- first, so that they happen one at a time, and the name's lock-delay state.
CREATE TABLE @schema@.names (
    name text PRIMARY KEY,
    -- Lock-delay: a set stays closed until then after a grant of it expired unreleased.
    lock_closed_until timestamptz,
    permit_closed_until timestamptz
);

-- One row per grant, its lease on the server's clock.
CREATE TABLE @schema@.grants (
    name text NOT NULL,
    owner text NOT NULL,
    mode "char" NOT NULL,          -- x exclusive, s shared (lock set); p permit (permit set)
    permit_limit integer,
    token bigint NOT NULL,
    expires timestamptz NOT NULL,
    lock_delay interval,
    value bytea,
    PRIMARY KEY (name, owner)
);

-- One row per waiting request, dropped when not refreshed before it expires.
CREATE TABLE @schema@.waiters (
    name text NOT NULL,
    owner text NOT NULL,
    mode "char" NOT NULL,
    permit_limit integer,
    fair boolean NOT NULL,         -- has a place in the queue (seq); otherwise only waits
    seq bigint NOT NULL,
    since timestamptz NOT NULL,
    expires timestamptz NOT NULL,
    PRIMARY KEY (name, owner)
);

-- Locks the name's row, making it if needed; whether it was made now (then the name has no
-- grant, no waiter and no lock-delay: they exist only under a name's row).
CREATE FUNCTION @schema@.lock_name(p_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        -- Inserted: the new row is ours until commit. A conflict with a row being inserted
        -- waits for that transaction.
        INSERT INTO @schema@.names (name) VALUES (p_name) ON CONFLICT DO NOTHING;
        IF FOUND THEN RETURN true; END IF;
        PERFORM 1 FROM @schema@.names n WHERE n.name = p_name FOR UPDATE;
        IF FOUND THEN RETURN false; END IF;
        -- Dropped between the two: look again.
    END LOOP;
END $$;

-- Drops the name's expired grants and waiters; an expired grant with a lock-delay closes its
-- set until its lease's end plus the delay. The caller holds the name's row. An expired
-- grant whose row a fenced write holds (see holds) is left, not waited for: it keeps the
-- next grant of its set out until that transaction has ended, and no statement of the
-- schema waits for a caller's transaction (a waiting statement would hold up everything
-- queued behind it on its connection). Whether every expired grant is gone.
CREATE FUNCTION @schema@.prune(p_name text, p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    WITH gone AS (
        DELETE FROM @schema@.grants g
        WHERE g.name = p_name
          AND g.owner IN (SELECT e.owner FROM @schema@.grants e
                          WHERE e.name = p_name AND e.expires <= p_now
                          FOR UPDATE SKIP LOCKED)
        RETURNING g.mode, g.expires + g.lock_delay AS until
    )
    UPDATE @schema@.names n SET
        lock_closed_until = greatest(n.lock_closed_until,
            (SELECT max(until) FROM gone WHERE mode <> 'p')),
        permit_closed_until = greatest(n.permit_closed_until,
            (SELECT max(until) FROM gone WHERE mode = 'p'))
    WHERE n.name = p_name AND EXISTS (SELECT 1 FROM gone WHERE until IS NOT NULL);
    DELETE FROM @schema@.waiters w WHERE w.name = p_name AND w.expires <= p_now;
    RETURN NOT EXISTS (SELECT 1 FROM @schema@.grants g
                       WHERE g.name = p_name AND g.expires <= p_now);
END $$;

-- Tells the waiters of one set of the name who may be granted now: the head of the queue
-- (readers and permits in a group), or everyone when some wait outside the queue. The
-- message is sent when the caller's transaction commits.
CREATE FUNCTION @schema@.wake(p_name text, p_permit boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_owners text[] := '{}';
    v_held bigint;
    v_exclusive boolean;
    r record;
BEGIN
    IF EXISTS (SELECT 1 FROM @schema@.waiters w
               WHERE w.name = p_name AND (w.mode = 'p') = p_permit AND NOT w.fair) THEN
        PERFORM pg_notify('@channel@', p_name || ' *');
        RETURN;
    END IF;
    IF p_permit THEN
        SELECT count(*) INTO v_held FROM @schema@.grants g WHERE g.name = p_name AND g.mode = 'p';
        FOR r IN SELECT w.owner, w.permit_limit FROM @schema@.waiters w
                 WHERE w.name = p_name AND w.mode = 'p' ORDER BY w.seq LIMIT 64 LOOP
            EXIT WHEN v_held + cardinality(v_owners) >= r.permit_limit;
            v_owners := v_owners || r.owner;
        END LOOP;
    ELSE
        SELECT count(*), coalesce(bool_or(g.mode = 'x'), false) INTO v_held, v_exclusive
        FROM @schema@.grants g WHERE g.name = p_name AND g.mode <> 'p';
        FOR r IN SELECT w.owner, w.mode FROM @schema@.waiters w
                 WHERE w.name = p_name AND w.mode <> 'p' ORDER BY w.seq LIMIT 64 LOOP
            EXIT WHEN v_exclusive;
            IF r.mode = 'x' THEN
                IF cardinality(v_owners) = 0 AND v_held = 0 THEN
                    v_owners := v_owners || r.owner;
                END IF;
                EXIT;
            END IF;
            v_owners := v_owners || r.owner;
        END LOOP;
    END IF;
    IF cardinality(v_owners) > 0 THEN
        PERFORM pg_notify('@channel@', p_name || ' ' || array_to_string(v_owners, ' '));
    END IF;
END $$;

-- Grants the name to the owner, or answers busy. One call, one round trip:
--   o_token     the grant's token; NULL when busy. The same token again when the owner
--               already holds (a retry after a lost reply), with a fresh lease.
--   o_retry_ms  when busy: in how many ms the state may change without a message (a lease
--               or a queue entry running out, a lock-delay ending); NULL if only a release
--               or a grant (both send a message) can change it.
--   o_waited_ms when busy and waiting: how long the owner has been waiting.
--   o_blocked   when busy: an expired grant stays until a fenced write holding it ends,
--               which sends no message (look again soon).
CREATE FUNCTION @schema@.acquire(
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
END $$;

-- Removes the owner's grant or queue entry of the name, and nothing else; wakes whom that
-- lets in. Whether there was anything to remove. A grant whose row a fenced write holds
-- (see holds) ends now all the same, without waiting for that transaction: its lease is
-- cut short (an update of the row does not wait for the write's lock), and prune drops it
-- once the transaction has ended.
CREATE FUNCTION @schema@.release(p_name text, p_owner text) RETURNS boolean
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
    RETURN v_found;
END $$;

-- Drops what vanished holders and waiters left under names nobody has touched since: the
-- rows of names whose grants and queue entries have all expired (and whose lock-delay has
-- ended), and advisory rows of sessions that are gone. Names another transaction holds, and
-- rows a fenced write holds, are skipped. How many names it dropped.
CREATE FUNCTION @schema@.sweep(p_limit integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_name text;
    v_swept integer := 0;
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
    DELETE FROM @schema@.advisory a
    WHERE (a.pid, a.started) IN (
        SELECT e.pid, e.started FROM @schema@.advisory e
        WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity s
                          WHERE s.pid = e.pid
                            AND (s.backend_start IS NULL OR s.backend_start = e.started))
        FOR UPDATE SKIP LOCKED);
    RETURN v_swept;
END $$;

-- Advisory mode ------------------------------------------------------------------------

-- The key of a name's advisory lock: names of other schemas are other locks. Two names may
-- share a key (a 64-bit hash): they then exclude each other, which is safe.
CREATE FUNCTION @schema@.advisory_key(p_name text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT hashtextextended('@schema@/' || p_name, 0) $$;

-- Who holds which advisory lock, with which token: one row per session (a held lock has a
-- connection of its own), named by its server process and the session's start (process ids
-- are handed out again; the two together never repeat). A row is current only while that
-- session lives and pg_locks shows it holding the name's key; the grant of a name removes
-- the rows it makes stale.
CREATE TABLE @schema@.advisory (
    pid integer NOT NULL,
    started timestamptz NOT NULL,
    name text NOT NULL,
    owner text NOT NULL,
    mode "char" NOT NULL,
    token bigint NOT NULL,
    session_ttl_ms bigint NOT NULL,
    value bytea,
    PRIMARY KEY (pid, started)
);
CREATE INDEX ON @schema@.advisory (name);

-- When this session started.
CREATE FUNCTION @schema@.advisory_session() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT s.backend_start FROM pg_stat_activity s WHERE s.pid = pg_backend_pid()
$$;

-- Whether the session of process p_pid that started at p_started holds the advisory key
-- now. A session of another role shows its start only to members of that role and of
-- pg_read_all_stats: to others it holds nothing.
CREATE FUNCTION @schema@.advisory_holds(p_pid integer, p_started timestamptz, p_key bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.pid = p_pid AND l.granted AND l.objsubid = 1
          AND s.backend_start = p_started
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND ((l.classid::bigint << 32) | l.objid::bigint) = p_key)
$$;

-- Takes the name's advisory lock for this session (waiting for it in the server's queue if
-- p_wait), then a token in the same transaction. NULL: busy (only without p_wait). The
-- session ends itself after p_ttl_ms without a statement (idle_session_timeout), which frees
-- its lock when its client is gone or cut off.
CREATE FUNCTION @schema@.advisory_acquire(
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
    -- Rows of holders this grant excludes are stale, and so is any earlier row under this
    -- process id (this session's, or a gone session's whose id was handed out again). They
    -- are removed, never updated: a fenced write holding one (see holds) makes this wait
    -- for its commit.
    DELETE FROM @schema@.advisory a
    WHERE a.pid = pg_backend_pid() OR (a.name = p_name AND (NOT p_shared OR a.mode = 'x'));
    INSERT INTO @schema@.advisory (pid, started, name, owner, mode, token, session_ttl_ms, value)
    VALUES (pg_backend_pid(), @schema@.advisory_session(), p_name, p_owner,
            CASE WHEN p_shared THEN 's' ELSE 'x' END, v_token, p_ttl_ms, p_value);
    IF p_value IS NOT NULL THEN PERFORM pg_notify('@channel@', p_name || ' *'); END IF;
    RETURN v_token;
END $$;

-- The token of this session's hold of the name, if it holds it (after a lost reply, or an
-- attempt that failed). A grant rolled back after its lock was taken (a statement timeout,
-- a deadlock, a cancel) leaves the session's lock without its row: whatever the session
-- holds without a grant of the name is given up, so that the next attempt takes the lock
-- once, and a release once gives it back.
CREATE FUNCTION @schema@.advisory_held(p_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_token bigint;
BEGIN
    SELECT a.token INTO v_token FROM @schema@.advisory a
    WHERE a.pid = pg_backend_pid() AND a.started = @schema@.advisory_session()
      AND a.name = p_name
      AND @schema@.advisory_holds(a.pid, a.started, @schema@.advisory_key(p_name));
    IF v_token IS NULL THEN
        PERFORM pg_advisory_unlock_all();
    END IF;
    RETURN v_token;
END $$;

-- Gives up this session's hold of the name; whether it held it (a live session keeps its
-- advisory locks until it unlocks them, so only a release of something never granted, or
-- sent twice, answers false). The session holds no advisory lock afterwards, and is a
-- plain one again (no idle timeout), ready for the next lock. Its row goes, unless a
-- fenced write holds it: then it stays, no longer current, for the next grant of the name
-- (which waits for that write) or a sweep to remove.
CREATE FUNCTION @schema@.advisory_release(p_name text, p_shared boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint := @schema@.advisory_key(p_name);
    v_held boolean;
    v_value bytea;
BEGIN
    v_held := @schema@.advisory_holds(pg_backend_pid(), @schema@.advisory_session(), v_key);
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

-- Fenced writes ------------------------------------------------------------------------

-- Whether the owner's grant of the name with this token is current: a lease that has not
-- run out, or an advisory lock whose session still holds it. It then locks the grant's row
-- until the caller's transaction ends, so that no later grant of the name (which removes
-- the row) completes before that transaction has committed or rolled back. The owner id
-- (unique per acquisition) is checked with the token: a token is unique too, unless an
-- asynchronous failover made the sequence hand it out again.
CREATE FUNCTION @schema@.holds(p_name text, p_token bigint, p_owner text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- A snapshot taken before a grant or a renewal hides it: the grant would be judged by
    -- an older state of it, and a current holder's write refused without a word.
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        RAISE EXCEPTION 'leasehold: still_owner needs a READ COMMITTED transaction, not %',
            upper(current_setting('transaction_isolation'))
        USING ERRCODE = 'feature_not_supported',
              DETAIL = 'The transaction''s snapshot hides grants and renewals committed after '
                       'it was taken, so the check would judge a current grant by an older '
                       'state of it.',
              HINT = 'Run the fenced statements in a READ COMMITTED transaction.';
    END IF;
    PERFORM 1 FROM @schema@.grants g
    WHERE g.name = p_name AND g.owner = p_owner AND g.token = p_token
      AND g.expires > clock_timestamp()
    FOR KEY SHARE;
    IF FOUND THEN RETURN true; END IF;
    -- The sessions as they are now: a transaction otherwise keeps its first look at
    -- pg_stat_activity.
    PERFORM pg_stat_clear_snapshot();
    PERFORM 1 FROM @schema@.advisory a
    WHERE a.name = p_name AND a.owner = p_owner AND a.token = p_token
      AND @schema@.advisory_holds(a.pid, a.started, @schema@.advisory_key(p_name))
    FOR KEY SHARE;
    RETURN FOUND;
END $$;
