-- leasehold: names for the keys and arguments, for everything after the fast paths.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot),
-- ordered so that an exclusive release or renewal passes only the first few (every key a
-- call passes costs the server time): a release 3 (4 with a lock-delay, 5 with a stored
-- value), a renewal 1 (6 with a lock-delay or a value). Every other call passes all 12;
-- the acquire fast path is a call of its own with its own 3 keys (see acquire.lua).
local LOCK, QUEUE = KEYS[1], KEYS[2]       -- exclusive holder: "<owner> <token>[ w]" (PX ttl); fair waiters: zset "<mode><owner>" -> arrival
local QEXP, DELAY = KEYS[3], KEYS[4]       -- every waiter ("~<mode><owner>" if not fair): zset -> expiry (ms); lock-delay: zset owner -> end of its delay
local XINFO, GATE = KEYS[5], KEYS[6]       -- the exclusive holder's value; the gate (below)
local TOKEN = KEYS[7]                      -- the fencing counter
local READERS, RINFO = KEYS[8], KEYS[9]    -- shared holders: zset owner -> expiry (ms); hash reader -> "token|value"
local PERMITS, PINFO = KEYS[10], KEYS[11]  -- permit holders: zset owner -> expiry (ms); hash owner -> "token|value"
local PDELAY = KEYS[12]                    -- lock-delay of permits
-- The gate exists for as long as any live member of READERS, QUEUE or DELAY may: until the
-- latest expiry written there (see hold_gate). So "neither LOCK nor GATE exists" means that
-- nobody holds, reads, queues for or delays the name, which is all the acquire fast path
-- checks. A gate may outlive its members; that only sends an acquire down the full path,
-- and the calls that remove the last of them drop it (see close_gate_if_idle).
-- The lock value ends in " w" while someone waits behind the exclusive holder: its release
-- then wakes them; without the mark a release is a plain compare-and-delete.
--
-- Arguments: owner, flags (mode 'x'/'s'/'p', fair, waiting, has value: "x110"), ttl ms, and
-- when any is not the default: permit limit, lock-delay ms, value. An exclusive release
-- without lock-delay or value passes the owner alone.
local OWNER, FLAGS, TTL = ARGV[1], ARGV[2] or 'x000', ARGV[3] or '0'
local MODE = string.sub(FLAGS, 1, 1)
local FAIR = string.sub(FLAGS, 2, 2) == '1'
local WAITING = string.sub(FLAGS, 3, 3) == '1'
local HAS_VALUE = string.sub(FLAGS, 4, 4) == '1'
local LIMIT, LOCK_DELAY, VALUE = tonumber(ARGV[4] or '0'), tonumber(ARGV[5] or '0'), ARGV[6] or ''
