-- leasehold: names for the keys and arguments, for everything after the fast paths.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot),
-- ordered so that an exclusive release or renewal passes only the first few (every key a
-- call passes costs the server time): a release 3 (4 with a lock-delay, 5 with a stored
-- value), a renewal 1 (5 with a lock-delay or a value). Every other call passes all 11;
-- the acquire fast path is a call of its own with its own 2 keys (see acquire.lua).
local LOCK, QUEUE = KEYS[1], KEYS[2]       -- the lock value (below); fair waiters: zset "<mode><owner>" -> arrival
local QEXP, DELAY = KEYS[3], KEYS[4]       -- every waiter ("~<mode><owner>" if not fair): zset -> expiry (ms); lock-delay: zset owner -> end of its delay
local XINFO, TOKEN = KEYS[5], KEYS[6]      -- the exclusive holder's value; the fencing counter
local READERS, RINFO = KEYS[7], KEYS[8]    -- shared holders: zset owner -> expiry (ms); hash reader -> "token|value"
local PERMITS, PINFO = KEYS[9], KEYS[10]   -- permit holders: zset owner -> expiry (ms); hash owner -> "token|value"
local PDELAY = KEYS[11]                    -- lock-delay of permits (passed only by calls with every key)
-- The lock key is also the gate: it exists while anyone holds the lock, reads, waits for
-- it (a live waiter entry) or delays it (a live lock-delay entry). So SET NX of the lock
-- key is all the acquire fast path needs. Its value is one of:
--   "<owner> <token>"           a holder whose lease is the key's expiry, with nobody
--                               waiting: its release is a plain compare-and-delete;
--   "<owner> w<until> <token>"  a holder whose lease ends at <until> (ms, server time)
--                               while the key may live on for others: its release wakes
--                               waiters and leaves the key as a gate if they remain;
--   GATE_ONLY                   nobody holds; the key only keeps the fast path shut.
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
