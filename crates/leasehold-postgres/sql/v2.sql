-- leasehold's PostgreSQL schema, version 2: force-release (evictions) in lease mode.
-- `@schema@` and `@channel@` as in v1.sql; run as v1 is (see src/schema.rs).

-- The last 10 evictions of each name, newest first by seq (the evicting function trims the
-- rest while it holds the name's row). A record outlives its name's row: it is there for an
-- operator to read after the fact, and for the evicted holder's renewal to find.
CREATE TABLE @schema@.evictions (
    name text NOT NULL,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    owner text NOT NULL,
    token bigint NOT NULL,
    evicted_by text NOT NULL,      -- user@host
    reason text NOT NULL,
    at_ms bigint NOT NULL,         -- ms since the Unix epoch, by the evicting host's clock
    PRIMARY KEY (name, seq)
);

-- Force-releases the owner's live grant of the name with this token, in p_mode's set (the
-- permit set for 'p', the lock set otherwise), and records the eviction; whether there was
-- such a grant. The set stays closed (lock_closed_until, permit_closed_until: the
-- lock-delay's columns, which acquire obeys) until the grant's lease would have ended, so
-- that its holder learns of the loss — its renewal finds the record, or its own deadline
-- passes — before anyone else is granted it. Every waiter is told to look again. A grant
-- whose row a fenced write holds (see holds) is not waited for: its lease is cut short,
-- which refuses its holder's next write, and prune drops the row once that transaction
-- has ended.
CREATE FUNCTION @schema@.evict(
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
    RETURN true;
END $$;
