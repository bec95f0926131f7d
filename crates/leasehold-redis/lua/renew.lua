-- renew: extend OWNER's grant by TTL if it is still OWNER's (compare and extend).
-- Returns 1 if extended, 0 if OWNER no longer holds it.
--
-- A keep (Backend::keep) is this call with TTL the hold and CHANNEL passed: the lease then
-- ends TTL from now, maybe sooner than waiters and observers were told, so it also tells
-- them all to look again (they learn the new end). A renewal passes no CHANNEL.

-- An exclusive holder without a lock-delay whose lease is the key's (see head.lua):
-- compare the owner (as release.lua does), then PEXPIRE the lock (and its stored value,
-- XINFO, when the call passes it).
if string.byte(FLAGS) == 120 and LOCK_DELAY == '0' then
  local value = redis.call('GET', LOCK)
  if not value or string.find(value, OWNER, 1, true) ~= 1 or string.byte(value, #OWNER + 1) ~= 32 then
    return 0
  end
  if string.byte(value, #OWNER + 2) ~= 119 then -- not "<owner> w<until> <token>"
    redis.call('PEXPIRE', LOCK, TTL)
    if XINFO then redis.call('PEXPIRE', XINFO, TTL) end
    if CHANNEL ~= '' then redis.call(PUBLISH, CHANNEL, '*') end
    return 1
  end
end

-- @prologue
-- @head
-- @common

local ttl = tonumber(TTL)
local now = now_ms()
if MODE == 'x' then
  -- Ours only while the lease in the value has not ended: the key may outlive it.
  local value = redis.call('GET', LOCK)
  if live_holder(value, now) ~= OWNER then return 0 end
  extend_holder(value, now, ttl)
  if XINFO then redis.call('PEXPIRE', XINFO, ttl) end
  if LOCK_DELAY > 0 then hold(DELAY, now + ttl + LOCK_DELAY, OWNER) end
  if CHANNEL ~= '' then redis.call(PUBLISH, CHANNEL, '*') end
  return 1
end
local zset, info, delay = READERS, RINFO, DELAY
if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
if not holds_grant(now) then
  prune_holders(zset, info, now)
  return 0
end
hold(zset, now + ttl, OWNER)
extend_set(zset, info)
if LOCK_DELAY > 0 then hold(delay, now + ttl + LOCK_DELAY, OWNER) end
if CHANNEL ~= '' then redis.call(PUBLISH, CHANNEL, '*') end
return 1
