-- fence: run an operation on TARGET only if its fencing token is not older than the
-- highest this fence (FENCE) has accepted, and remember the token. Standalone script.
local FENCE, TARGET = KEYS[1], KEYS[2]
-- TOKEN (decimal), OP 'get' | 'set' | 'incrby', OPERAND the value or delta.
local TOKEN, OP, OPERAND = ARGV[1], ARGV[2], ARGV[3]
-- Returns {1, result} when applied ('get': the value or false; 'set': 'OK'; 'incrby': the
-- new value), or {0, highest} when the token is stale.
--
-- Reads go through the fence too: a new holder's first read registers its token, so a
-- superseded holder's later write is refused even though it had read earlier.
local token = tonumber(TOKEN)
local highest = redis.call('GET', FENCE)
if highest and token < tonumber(highest) then
  return {0, tonumber(highest)}
end
redis.call('SET', FENCE, TOKEN)
if OP == 'get' then
  return {1, redis.call('GET', TARGET)}
elseif OP == 'set' then
  redis.call('SET', TARGET, OPERAND)
  return {1, 'OK'}
end
return {1, redis.call('INCRBY', TARGET, OPERAND)}
