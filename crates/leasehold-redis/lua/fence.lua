-- fence: run an operation on KEYS[2] only if its fencing token is not older than the
-- highest this fence (KEYS[1]) has accepted, and remember the token. Standalone script.
-- ARGV[1] token (decimal), ARGV[2] 'get' | 'set' | 'incrby', ARGV[3] value or delta.
-- Returns {1, result} when applied ('get': the value or false; 'set': 'OK'; 'incrby': the
-- new value), or {0, highest} when the token is stale.
--
-- Reads go through the fence too: a new holder's first read registers its token, so a
-- superseded holder's later write is refused even though it had read earlier.
local token = tonumber(ARGV[1])
local highest = redis.call('GET', KEYS[1])
if highest and token < tonumber(highest) then
  return {0, tonumber(highest)}
end
redis.call('SET', KEYS[1], ARGV[1])
if ARGV[2] == 'get' then
  return {1, redis.call('GET', KEYS[2])}
elseif ARGV[2] == 'set' then
  redis.call('SET', KEYS[2], ARGV[3])
  return {1, 'OK'}
end
return {1, redis.call('INCRBY', KEYS[2], ARGV[3])}
