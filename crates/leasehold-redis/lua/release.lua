-- release: remove OWNER's grant, or its waiter entry; nothing of anyone else's. Wakes the
-- waiters that may now be granted. Returns 1 if something was removed, else 0.

-- The common case: an exclusive holder, nobody waiting.
local released = false
if MODE == 'x' and is_mine(redis.call('GET', LOCK)) then
  redis.call('DEL', LOCK, XINFO)
  if not NO_DELAY then redis.call('ZREM', DELAY, OWNER) end
  if redis.call('EXISTS', QEXP) == 0 then return 1 end
  released = true
end

-- @common

local now = now_ms()
if released then
  prune_queue(now)
  wake_next(false, 0)
  return 1
end
if MODE ~= 'x' then
  local zset, info, delay = READERS, RINFO, DELAY
  if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
  local expires = redis.call('ZSCORE', zset, OWNER)
  if expires then
    redis.call('ZREM', zset, OWNER)
    redis.call('HDEL', info, OWNER)
    redis.call('ZREM', delay, OWNER)
    if tonumber(expires) > now then
      prune_queue(now)
      wake_next(MODE == 'p', LIMIT)
      return 1
    end
    return 0
  end
end
local me = MODE .. OWNER
local gone = redis.call('ZREM', QEXP, me, '~' .. OWNER)
if redis.call('ZREM', QUEUE, me) == 1 or gone > 0 then
  prune_queue(now)
  -- If it was at the head, whoever is next may now go first.
  wake_next(MODE == 'p', LIMIT)
  return 1
end
return 0
