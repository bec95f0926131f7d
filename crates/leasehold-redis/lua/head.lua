-- leasehold: what every script starts with. Kept small: the fast paths run right after it,
-- before the helpers in common.lua are even defined.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot),
-- ordered so that the fast paths touch only the first few: a call that can only take a fast
-- path passes just those keys (5 for an exclusive acquire, 7 for an exclusive renew or
-- release), every other call passes all 11.
local LOCK, TOKEN = KEYS[1], KEYS[2]       -- exclusive holder: "<owner> <token>" (SET ... PX ttl); the fencing counter
local READERS, QUEUE = KEYS[3], KEYS[4]    -- shared holders: zset owner -> expiry (ms); fair waiters: zset "<mode><owner>" -> arrival
local DELAY, QEXP = KEYS[5], KEYS[6]       -- lock-delay: zset owner -> end of its delay; every waiter: zset -> expiry (ms)
local XINFO, RINFO = KEYS[7], KEYS[8]      -- the exclusive holder's value; hash reader -> "token|value"
local PERMITS, PINFO = KEYS[9], KEYS[10]   -- permit holders: zset owner -> expiry (ms); hash owner -> "token|value"
local PDELAY = KEYS[11]                    -- lock-delay of permits
-- Arguments: owner, flags (mode 'x'/'s'/'p', fair, waiting, has value: "x110"), ttl ms, and
-- when any is not the default: permit limit, lock-delay ms, value.
local OWNER, FLAGS, TTL = ARGV[1], ARGV[2], ARGV[3]
local MODE = string.sub(FLAGS, 1, 1)
local NO_DELAY = (ARGV[5] or '0') == '0'

-- Lua numbers are doubles: format integers without an exponent.
local function int(n)
  return string.format('%.0f', n)
end

-- The next fencing token. A missing counter (a new name, or a server that lost its data)
-- starts from the server's clock in microseconds, so tokens never go backwards after an
-- empty restart as long as the server's clock does not.
local function next_token()
  local t = redis.call('INCR', TOKEN)
  if t == 1 then
    local now = redis.call('TIME')
    t = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', TOKEN, int(t))
  end
  return t
end

-- Whether a lock value "<owner> <token>" is OWNER's.
local function is_mine(value)
  return value and string.sub(value, 1, #OWNER + 1) == OWNER .. ' '
end
