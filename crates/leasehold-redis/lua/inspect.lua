-- @prologue
-- @head
-- @common

-- inspect: the state of one name.
-- Returns {"<owner> <token>" of the exclusive holder or '', its ms left, its value or '', readers, permits, waiters, evictions}
-- where readers and permits are flat lists owner, ms left, "token|value", ... and waiters is
-- the fair queue in order, each member "<mode><owner>" ("p<owner>/<limit>" for a permit);
-- evictions are the latest records, newest first (empty if the key is not a list).
local now = now_ms()
prune_all(now)
local value = redis.call('GET', LOCK)
local foreign = check_foreign(value)
if foreign then return foreign end
-- The exclusive holder as "<owner> <token>" and its ms left (the lock key may outlive it).
local holder, token = live_holder(value, now)
local shown, left = '', -2
if holder then
  shown = lock_value(holder, token, false)
  local _, _, ends = parse_lock(value)
  if ends then left = ends - now else left = redis.call('PTTL', LOCK) end
end
local function holders(zset, info)
  local out = {}
  local members = redis.call('ZRANGE', zset, 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    table.insert(out, members[i])
    table.insert(out, tonumber(members[i + 1]) - now)
    table.insert(out, redis.call('HGET', info, members[i]) or '')
  end
  return out
end
-- The records are an audit trail: a key of another type under their name is not an error.
local evictions = redis.pcall('LRANGE', EVICTED, 0, RECORDS_KEPT - 1)
if evictions.err then evictions = {} end
return {
  shown,
  left,
  redis.call('GET', XINFO) or '',
  holders(READERS, RINFO),
  holders(PERMITS, PINFO),
  redis.call('ZRANGE', QUEUE, 0, -1),
  evictions,
}
