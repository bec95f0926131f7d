-- leasehold's PostgreSQL schema, version 3: records beside a lock (scheduled jobs), both
-- modes. `@schema@` and `@channel@` as in v1.sql; run as v1 is (see src/schema.rs).

-- Records written by a name's holders, each kept until expires_at by the server's clock.
-- A record outlives its name's row and its writer's grant: it is there for the grants that
-- follow. Neither listings (which read names and advisory) nor inspect read this table.
-- Reads skip an expired record; the writing statement drops the name's expired records,
-- and the sweep (see src/statements.rs, Stmt::Sweep) those of names nobody writes anymore.
CREATE TABLE IF NOT EXISTS @schema@.records (
    name text NOT NULL,
    key text NOT NULL,
    value bytea NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, key)
);
CREATE INDEX IF NOT EXISTS records_expires_at ON @schema@.records (expires_at);
