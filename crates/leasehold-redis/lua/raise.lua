-- @prologue
-- @head
-- @common
-- raise: make sure the fencing counter is at least FLOOR, and record FLOOR as OWNER's
-- token if OWNER holds the lock here. Used after a client saw the server hand out a token
-- lower than one it had already seen (the server lost data), and by Redlock to write the
-- token of a grant back to the nodes.
local floor = tonumber(FLOOR)
local current = tonumber(redis.call('GET', TOKEN) or '0')
if current < floor then
  redis.call('SET', TOKEN, int(floor))
end
if MODE == 'x' then
  local owner, _, ends = parse_lock(redis.call('GET', LOCK))
  if owner == OWNER then redis.call('SET', LOCK, lock_value(OWNER, floor, ends), 'KEEPTTL') end
elseif MODE == 's' then
  local info = redis.call('HGET', RINFO, OWNER)
  if info then
    redis.call('HSET', RINFO, OWNER, int(floor) .. string.sub(info, string.find(info, '|', 1, true)))
  end
end
return 1
