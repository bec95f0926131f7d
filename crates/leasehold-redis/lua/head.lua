-- leasehold: names for the keys and arguments, for everything after the fast paths.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot),
-- ordered so that an exclusive release or renewal passes only the first few (every key a
-- call passes costs the server time): a release 3 (4 with a lock-delay, 5 with a stored
-- value), a renewal 1 (5 with a lock-delay or a value). Every other call passes all 11;
-- the acquire fast path is a call of its own with its own 5 keys (see acquire.lua).
local LOCK, QUEUE = KEYS[1], KEYS[2]       -- exclusive holder: "<owner> <token>[ w]" (PX ttl); fair waiters: zset "<mode><owner>" -> arrival
local QEXP, DELAY = KEYS[3], KEYS[4]       -- every waiter ("~<mode><owner>" if not fair): zset -> expiry (ms); lock-delay: zset owner -> end of its delay
local XINFO, TOKEN = KEYS[5], KEYS[6]      -- the exclusive holder's value; the fencing counter
local READERS, RINFO = KEYS[7], KEYS[8]    -- shared holders: zset owner -> expiry (ms); hash reader -> "token|value"
local PERMITS, PINFO = KEYS[9], KEYS[10]   -- permit holders: zset owner -> expiry (ms); hash owner -> "token|value"
local PDELAY = KEYS[11]                    -- lock-delay of permits
-- The lock value ends in " w" while someone waits behind the exclusive holder: its release
-- then wakes them; without the mark a release is a plain compare-and-delete.
--
-- Arguments: owner, flags (mode 'x'/'s'/'p', fair, waiting, has value: "x110"), ttl ms, and
-- when any is not the default: permit limit, lock-delay ms, value.
local OWNER, FLAGS, TTL = ARGV[1], ARGV[2], ARGV[3]
local MODE = string.sub(FLAGS, 1, 1)
local FAIR = string.sub(FLAGS, 2, 2) == '1'
local WAITING = string.sub(FLAGS, 3, 3) == '1'
local HAS_VALUE = string.sub(FLAGS, 4, 4) == '1'
local LIMIT, LOCK_DELAY, VALUE = tonumber(ARGV[4] or '0'), tonumber(ARGV[5] or '0'), ARGV[6] or ''
