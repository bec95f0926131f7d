-- leasehold: the fencing counter, included at a body's `-- @token` marker.

-- The next fencing token from the counter at `key`. A missing counter (a new name, or a
-- server that lost its data) starts from the server's clock in microseconds, so tokens
-- never go backwards after an empty restart as long as the server's clock does not.
local function next_token(key)
  local t = redis.call('INCR', key)
  if t == 1 then
    local now = redis.call('TIME')
    t = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', key, string.format('%d', t))
  end
  return t
end
