-- acquire: grant the lock to OWNER, or answer busy. One integer (cheaper than a table):
--   > 0   granted, this is the token (the same token again if OWNER already holds it,
--         unless FLAGS ask for a fresh one);
--   {token, µs}  granted to a waiting request over the gate a release left: the token, and
--         how long the name stood released (the hand-off, on the server's clock);
--   0     (the fast path only, acquire_fast.lua) the name is not simply free;
--   -1    busy, nothing will change without a wake-up message;
--   < -1  busy, the state may change on its own in -(answer + 2) ms (an expiry, or the end
--         of a Redlock node's quarantine);
--   {busy, counter}  busy, to a waiter a release may hand the lock to (see `me` below):
--         the answer as above, and the fencing counter, which any token handed to it later
--         is above.
-- @token
-- @quarantine
-- @prologue
-- @head
-- @common

local ttl = tonumber(TTL)
local now = now_ms()
prune_all(now)
local value = redis.call('GET', LOCK)
local foreign = check_foreign(value)
if foreign then return foreign end
local holder, held_token = live_holder(value, now)

-- Already ours (a retry after a lost reply): renew and answer with the same token. A
-- Redlock node answers with a fresh token instead (FRESH_TOKEN): the stored one dates from
-- the earlier attempt, and other grants may have raised the counter since; Redlock's
-- majority arithmetic needs every answer to stand above the counter as it is now.
if MODE == 'x' and holder == OWNER then
  if FRESH_TOKEN then
    held_token = next_token(TOKEN)
    local _, _, ends = parse_lock(value)
    value = lock_value(OWNER, held_token, ends)
    redis.call('SET', LOCK, value, 'KEEPTTL')
  end
  extend_holder(value, now, ttl)
  redis.call('PEXPIRE', XINFO, ttl)
  if LOCK_DELAY > 0 then hold(DELAY, now + ttl + LOCK_DELAY, OWNER) end
  return held_token
end
local zset, info, delay = READERS, RINFO, DELAY
if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
if MODE ~= 'x' and redis.call('ZSCORE', zset, OWNER) then
  hold(zset, now + ttl, OWNER)
  extend_set(zset, info)
  if LOCK_DELAY > 0 then hold(delay, now + ttl + LOCK_DELAY, OWNER) end
  local token = token_of(redis.call('HGET', info, OWNER))
  if token ~= 0 and FRESH_TOKEN then
    token = next_token(TOKEN)
    redis.call('HSET', info, OWNER, info_of(token))
  end
  if token == 0 then
    return redis.error_reply('LEASEHOLD_FOREIGN ' .. info .. ' has no token for ' .. OWNER .. '; it was not written by leasehold')
  end
  return token
end

local function in_set(member)
  local kind = string.sub(member, 1, 1)
  if MODE == 'p' then return kind == 'p' end
  return kind == 'x' or kind == 'h' or kind == 's'
end

-- Our place in the queue, taken (or kept fresh) by a fair waiting request. A waiting
-- request that is not fair leaves only an expiring entry "~<mode><owner>", so releases know
-- to wake it, and new readers know a writer is waiting.
-- An exclusive waiter with nothing to store at its grant (no value, no lock-delay) on a
-- single server queues as "h<owner>": a release hands the lock straight to it (release.lua).
local me = member_of(MODE, OWNER, LIMIT)
local HANDED_TO = MODE == 'x' and FAIR and WAITING and not HAS_VALUE and LOCK_DELAY == 0
  and PLACE == '0'
if HANDED_TO then me = 'h' .. OWNER end
local rank = false
if FAIR then rank = redis.call('ZRANK', QUEUE, me) end
if FAIR and WAITING then
  if not rank then
    -- A place given (a Redlock node's waiter: when its acquisition began) orders the queue
    -- the same way on every node; ties go by member. A place more than a lease away from
    -- this server's clock (a client's clock far off) is brought within it.
    local seq = tonumber(PLACE)
    if seq ~= 0 then
      seq = math.min(math.max(seq, now - ttl), now + ttl)
    else
      local last = redis.call('ZRANGE', QUEUE, -1, -1, 'WITHSCORES')
      seq = 1
      if #last > 0 then seq = tonumber(last[2]) + 1 end
    end
    redis.call('ZADD', QUEUE, seq, me)
    rank = redis.call('ZRANK', QUEUE, me)
  end
  redis.call('ZADD', QEXP, now + ttl, me)
elseif WAITING then
  redis.call('ZADD', QEXP, now + ttl, '~' .. me)
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
    local kind = string.sub(m, 1, 1)
    if kind == 'x' or kind == 'h' then ok = false end
  end
  -- Without a queue, a waiting writer still keeps new readers out: writers do not starve.
  if not FAIR then
    for _, m in ipairs(redis.call('ZRANGE', QEXP, 0, -1)) do
      if string.sub(m, 1, 2) == '~x' then ok = false end
    end
  end
else
  -- Each permit with its own limit; granted before the waiters ahead claim their places
  -- only if each of them still fits after it (the contract's rule, support::queue).
  local before = redis.call('ZCARD', PERMITS) + #ahead
  ok = ok and before < LIMIT
  for _, m in ipairs(ahead) do
    local _, limit = permit_of(m)
    if not limit or before >= limit then ok = false end
  end
end

if ok then
  if rank then redis.call('ZREM', QUEUE, me) end
  redis.call('ZREM', QEXP, me, '~' .. me)
  local token = next_token(TOKEN)
  local handoff = false
  if MODE == 'x' then
    if WAITING then handoff = since_release(value) end
    redis.call('SET', LOCK, lock_value(OWNER, token, false), 'PX', ttl)
    if HAS_VALUE then redis.call('SET', XINFO, VALUE, 'PX', ttl) end
    -- Others still waiting: keep the key up for them (which marks our value with the end
    -- of our lease, so that our release wakes them).
    local last = redis.call('ZRANGE', QEXP, -1, -1, 'WITHSCORES')
    if #last > 0 then hold_gate(tonumber(last[2])) end
  else
    hold(zset, now + ttl, OWNER)
    redis.call('HSET', info, OWNER, info_of(token))
    extend_set(zset, info)
    if MODE == 's' then mark_gate(false) end
    -- Shared holders and permits are granted in groups: let the next waiters try.
    if FAIR and rank then wake_next(MODE == 'p') end
  end
  if LOCK_DELAY > 0 then hold(delay, now + ttl + LOCK_DELAY, OWNER) end
  if HAS_VALUE then redis.call(PUBLISH, CHANNEL, '*') end
  if handoff then return {token, handoff} end
  return token
end

-- Busy and waiting (fair, or behind an exclusive holder or readers): keep the lock key up
-- as the gate for as long as our entry lives. A holder's value gets marked with the end of
-- its lease, so that its release wakes us.
if WAITING and (FAIR or MODE ~= 'p') then hold_gate(now + ttl) end

-- When could it change without anyone publishing? At the earliest expiry of a holder, a
-- waiter entry, or a lock-delay.
local next_change = nil
local function consider(at)
  at = tonumber(at)
  if at and (next_change == nil or at < next_change) then next_change = at end
end
if holder then
  local _, _, ends = parse_lock(value)
  if ends then
    consider(ends)
  else
    local left = redis.call('PTTL', LOCK)
    if left > 0 then consider(now + left) end
  end
end
for _, set in ipairs({zset, QEXP, delay}) do
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  if #first > 0 then consider(first[2]) end
end
local busy = -1
if next_change ~= nil then busy = -(math.max(next_change - now, 1) + 2) end
if HANDED_TO then return {busy, tonumber(redis.call('GET', TOKEN)) or 0} end
return busy
