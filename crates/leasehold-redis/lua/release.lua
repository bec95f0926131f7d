-- release: remove OWNER's grant, or its place in the queue; nothing of anyone else's.
-- Wakes the waiters that may now be granted. Returns 1 if something was removed, else 0.
local now = now_ms()
if MODE == 'x' then
  if redis.call('GET', LOCK) == OWNER then
    redis.call('DEL', LOCK, XINFO)
    redis.call('ZREM', DELAY, OWNER)
    prune_queue(now)
    wake_next(false, 0)
    return 1
  end
else
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
if redis.call('ZREM', QUEUE, me) == 1 then
  redis.call('ZREM', QEXP, me)
  prune_queue(now)
  -- If it was at the head, whoever is next may now go first.
  wake_next(MODE == 'p', LIMIT)
  return 1
end
return 0
