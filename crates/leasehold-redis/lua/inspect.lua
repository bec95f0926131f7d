-- @prologue
-- @head
-- @common

-- inspect: the state of one name.
-- Returns {exclusive lock value or '', its ms left, its value or '', readers, permits, waiters}
-- where readers and permits are flat lists owner, ms left, "token|value", ... and waiters is
-- the fair queue in order, each member "<mode><owner>".
local now = now_ms()
prune_all(now)
local value = redis.call('GET', LOCK)
local foreign = check_foreign(value)
if foreign then return foreign end
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
return {
  value or '',
  redis.call('PTTL', LOCK),
  redis.call('GET', XINFO) or '',
  holders(READERS, RINFO),
  holders(PERMITS, PINFO),
  redis.call('ZRANGE', QUEUE, 0, -1),
}
