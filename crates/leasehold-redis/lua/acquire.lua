-- acquire: grant the lock to OWNER, or answer busy.
-- Returns {1, token} when granted (again, with the same token, if OWNER already holds it),
-- {0, ms} when busy: ms until the state may change without a wake-up message (-1: none),
-- or {2, 0} from a fast-path call (5 keys) that could not take the fast path: call again
-- with all keys.

-- The uncontended exclusive grant: SET NX PX of "<owner> <token>", one INCR. (Requests with
-- a value or a lock-delay take the full path.)
if MODE == 'x' and NO_DELAY and string.sub(FLAGS, 4, 4) ~= '1'
    and redis.call('EXISTS', LOCK, READERS, QUEUE, DELAY) == 0 then
  local token = next_token()
  redis.call('SET', LOCK, OWNER .. ' ' .. int(token), 'NX', 'PX', TTL)
  return {1, token}
end
if #KEYS < 11 then return {2, 0} end

-- @common

local ttl = tonumber(TTL)
local now = now_ms()
prune_all(now)
local value = redis.call('GET', LOCK)
local foreign = check_foreign(value)
if foreign then return foreign end
local holder = owner_of(value)

-- Already ours (a retry after a lost reply): renew and answer with the same token.
if MODE == 'x' and holder == OWNER then
  redis.call('PEXPIRE', LOCK, ttl)
  redis.call('PEXPIRE', XINFO, ttl)
  if LOCK_DELAY > 0 then redis.call('ZADD', DELAY, now + ttl + LOCK_DELAY, OWNER) end
  return {1, token_in(value)}
end
local zset, info, delay = READERS, RINFO, DELAY
if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
if MODE ~= 'x' and redis.call('ZSCORE', zset, OWNER) then
  redis.call('ZADD', zset, now + ttl, OWNER)
  extend_set(zset, info)
  if LOCK_DELAY > 0 then redis.call('ZADD', delay, now + ttl + LOCK_DELAY, OWNER) end
  return {1, token_of(redis.call('HGET', info, OWNER))}
end

local function in_set(member)
  local kind = string.sub(member, 1, 1)
  if MODE == 'p' then return kind == 'p' end
  return kind == 'x' or kind == 's'
end

-- Our place in the queue, taken (or kept fresh) by a fair waiting request. A waiting
-- request that is not fair leaves only an expiring entry, so releases know to wake it.
local me = MODE .. OWNER
local rank = false
if FAIR then rank = redis.call('ZRANK', QUEUE, me) end
if FAIR and WAITING then
  if not rank then
    local last = redis.call('ZRANGE', QUEUE, -1, -1, 'WITHSCORES')
    local seq = 1
    if #last > 0 then seq = tonumber(last[2]) + 1 end
    redis.call('ZADD', QUEUE, seq, me)
    rank = redis.call('ZRANK', QUEUE, me)
  end
  redis.call('ZADD', QEXP, now + ttl, me)
elseif WAITING then
  redis.call('ZADD', QEXP, now + ttl, '~' .. OWNER)
end
local ahead = {}
if FAIR and rank ~= 0 then
  local upto = -1
  if rank then upto = rank - 1 end
  for _, m in ipairs(redis.call('ZRANGE', QUEUE, 0, upto)) do
    if in_set(m) then table.insert(ahead, m) end
  end
end

-- Lock-delay: an entry of an owner that no longer holds means its lease expired recently.
local function holds(owner)
  if MODE == 'p' then return redis.call('ZSCORE', PERMITS, owner) ~= false end
  return owner == holder or redis.call('ZSCORE', READERS, owner) ~= false
end
local closed = false
for _, owner in ipairs(redis.call('ZRANGE', delay, 0, -1)) do
  if not holds(owner) then closed = true end
end

local ok = not closed
if MODE == 'x' then
  ok = ok and not holder and redis.call('ZCARD', READERS) == 0 and #ahead == 0
elseif MODE == 's' then
  ok = ok and not holder
  for _, m in ipairs(ahead) do
    if string.sub(m, 1, 1) == 'x' then ok = false end
  end
else
  ok = ok and redis.call('ZCARD', PERMITS) + #ahead < LIMIT
end

if ok then
  if rank then redis.call('ZREM', QUEUE, me) end
  redis.call('ZREM', QEXP, me, '~' .. OWNER)
  local token = next_token()
  if MODE == 'x' then
    redis.call('SET', LOCK, OWNER .. ' ' .. int(token), 'PX', ttl)
    if HAS_VALUE then redis.call('SET', XINFO, VALUE, 'PX', ttl) end
  else
    redis.call('ZADD', zset, now + ttl, OWNER)
    redis.call('HSET', info, OWNER, info_of(token))
    extend_set(zset, info)
    -- Shared holders and permits are granted in groups: let the next waiters try.
    if FAIR and rank then wake_next(MODE == 'p', LIMIT) end
  end
  if LOCK_DELAY > 0 then redis.call('ZADD', delay, now + ttl + LOCK_DELAY, OWNER) end
  if HAS_VALUE then redis.call('PUBLISH', CHANNEL, '*') end
  return {1, token}
end

-- Busy. When could it change without anyone publishing? At the earliest expiry of a
-- holder, a waiter entry, or a lock-delay.
local next_change = nil
local function consider(at)
  at = tonumber(at)
  if at and (next_change == nil or at < next_change) then next_change = at end
end
if holder then
  local left = redis.call('PTTL', LOCK)
  if left > 0 then consider(now + left) end
end
for _, set in ipairs({zset, QEXP, delay}) do
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  if #first > 0 then consider(first[2]) end
end
if next_change == nil then return {0, -1} end
return {0, math.max(next_change - now, 1)}
