-- leasehold: names for the keys and arguments, for everything after the fast paths.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot),
-- ordered so that the fast paths touch only the first few: a call that can only take a fast
-- path passes just those keys (5 for an exclusive acquire, 7 for an exclusive renew or
-- release), every other call passes all 11.
local LOCK, TOKEN = KEYS[1], KEYS[2]       -- exclusive holder: "<owner> <token>[ w]" (PX ttl); the fencing counter
local READERS, QUEUE = KEYS[3], KEYS[4]    -- shared holders: zset owner -> expiry (ms); fair waiters: zset "<mode><owner>" -> arrival
local DELAY, QEXP = KEYS[5], KEYS[6]       -- lock-delay: zset owner -> end of its delay; every waiter ("~<mode><owner>" if not fair): zset -> expiry (ms)
local XINFO, RINFO = KEYS[7], KEYS[8]      -- the exclusive holder's value; hash reader -> "token|value"
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
