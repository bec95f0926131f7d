-- release: remove OWNER's grant, or its waiter entry; nothing of anyone else's. Wakes the
-- waiters that may now be granted. Returns 1 if something was removed, else 0.

-- An exclusive holder nobody waits for, without a lock-delay: compare the owner (without
-- building a string: the value is "<owner> <token>[ w]"), then DEL the lock (and its stored
-- value, the 5th key when passed). Such a release passes the owner alone (no flags: 'x').
local released = false
if not ARGV[2] or string.byte(ARGV[2]) == 120 then -- 'x'
  local value = redis.call('GET', KEYS[1])
  if value and string.find(value, ARGV[1], 1, true) == 1 and string.byte(value, #ARGV[1] + 1) == 32 then
    if KEYS[5] then redis.call('DEL', KEYS[1], KEYS[5]) else redis.call('DEL', KEYS[1]) end
    -- Unmarked (a token ends in a digit, a mark in 'w'), no lock-delay entry to drop: done.
    if string.byte(value, -1) ~= 119 and (ARGV[5] or '0') == '0' then return 1 end
    released = true
  end
end

-- @prologue
-- @head
-- @common

local now = now_ms()
if released then
  if LOCK_DELAY > 0 then redis.call('ZREM', DELAY, OWNER) end
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
    close_gate_if_idle()
    if tonumber(expires) > now then
      prune_queue(now)
      wake_next(MODE == 'p', LIMIT)
      return 1
    end
    return 0
  end
end
local me = MODE .. OWNER
local gone = redis.call('ZREM', QEXP, me, '~' .. me)
if redis.call('ZREM', QUEUE, me) == 1 or gone > 0 then
  prune_queue(now)
  close_gate_if_idle()
  -- If it was at the head, whoever is next may now go first.
  wake_next(MODE == 'p', LIMIT)
  return 1
end
return 0
