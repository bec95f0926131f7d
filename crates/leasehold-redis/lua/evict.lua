-- @prologue
-- @head
-- @common

-- evict: force-release OWNER's grant in MODE if its token is GRANT (never a newer grant),
-- and record RECORD. Returns 1 if the grant was removed, 0 if it was not held.
--
-- The set stays closed to new grants until the evicted lease would have ended, by a
-- lock-delay entry of OWNER until then (longer if OWNER's own lock-delay says so): acquire
-- refuses while an entry of an owner that no longer holds lives, and for the lock set the
-- lock key stays up as the gate, so the fast path's SET NX fails too. So the evicted
-- holder finds out, at its next renewal or its deadline, before anyone else is granted.
-- The records (newest first) keep RECORDS_KEPT and expire RECORDS_TTL ms after the latest.

-- Refuse before changing anything: a script's writes are not rolled back by an error.
local kind = redis.call('TYPE', EVICTED)['ok']
if kind ~= 'none' and kind ~= 'list' then
  return redis.error_reply('LEASEHOLD_FOREIGN ' .. EVICTED .. ' holds a ' .. kind .. ' not written by leasehold (a list of evictions)')
end

local grant = tonumber(GRANT)
local now = now_ms()
-- When the evicted lease would have ended on this server (ms).
local ends
local delay = DELAY
if MODE == 'x' then
  local value = redis.call('GET', LOCK)
  local owner, token, lease = parse_lock(value)
  if owner ~= OWNER or token ~= grant then return 0 end
  if not lease then lease = redis.call('PEXPIRETIME', LOCK) end
  if lease <= now then return 0 end
  ends = lease
  if XINFO then redis.call('DEL', XINFO) end
  -- The key keeps its expiry (at least the lease's end) as the gate alone.
  redis.call('SET', LOCK, GATE_ONLY, 'KEEPTTL')
else
  local zset, info = READERS, RINFO
  if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
  local lease = tonumber(redis.call('ZSCORE', zset, OWNER))
  if not lease or lease <= now or token_of(redis.call('HGET', info, OWNER)) ~= grant then
    return 0
  end
  ends = lease
  redis.call('ZREM', zset, OWNER)
  redis.call('HDEL', info, OWNER)
end

local delayed = tonumber(redis.call('ZSCORE', delay, OWNER))
if delayed and delayed > ends then ends = delayed end
hold(delay, ends, OWNER)

redis.call('LPUSH', EVICTED, RECORD)
redis.call('LTRIM', EVICTED, 0, RECORDS_KEPT - 1)
redis.call('PEXPIRE', EVICTED, RECORDS_TTL)
-- Waiters and observers look again: they find the set closed until `ends`, and when.
redis.call(PUBLISH, CHANNEL, '*')
return 1
