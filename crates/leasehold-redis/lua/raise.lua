-- @head
-- raise: make sure the fencing counter is at least ARGV[6] (after a client saw the server
-- hand out a token lower than one it had already seen: the server lost data).
local floor = tonumber(ARGV[6])
local current = tonumber(redis.call('GET', TOKEN) or '0')
if current < floor then
  redis.call('SET', TOKEN, int(floor))
  return 1
end
return 0
