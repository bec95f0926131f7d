-- renew: extend OWNER's grant by TTL if it is still OWNER's (compare and extend).
-- Returns 1 if extended, 0 if OWNER no longer holds it.
if MODE == 'x' then
  if redis.call('GET', LOCK) ~= OWNER then return 0 end
  redis.call('PEXPIRE', LOCK, TTL)
  redis.call('PEXPIRE', XINFO, TTL)
  if LOCK_DELAY > 0 then redis.call('ZADD', DELAY, now_ms() + TTL + LOCK_DELAY, OWNER) end
  return 1
end
local zset, info, delay = READERS, RINFO, DELAY
if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
local now = now_ms()
local expires = redis.call('ZSCORE', zset, OWNER)
if not expires or tonumber(expires) <= now then
  prune_holders(zset, info, now)
  return 0
end
redis.call('ZADD', zset, now + TTL, OWNER)
extend_set(zset, info)
if LOCK_DELAY > 0 then redis.call('ZADD', delay, now + TTL + LOCK_DELAY, OWNER) end
return 1
