-- inspect: the state of one name.
-- Returns {exclusive owner or '', its ms left, its info or '', readers, permits, waiters}
-- where readers and permits are flat lists owner, ms left, info, ... and waiters is the
-- queue in order, each member "<mode><owner>".
local now = now_ms()
prune_all(now)
local holder = redis.call('GET', LOCK)
local foreign = check_foreign(holder)
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
  holder or '',
  redis.call('PTTL', LOCK),
  redis.call('GET', XINFO) or '',
  holders(READERS, RINFO),
  holders(PERMITS, PINFO),
  redis.call('ZRANGE', QUEUE, 0, -1),
}
