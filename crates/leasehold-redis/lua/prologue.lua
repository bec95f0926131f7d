-- leasehold: the two helpers every script needs, included at its `-- @prologue` marker:
-- before the acquire fast path (which draws a token), after the release and renewal fast
-- paths (which need neither, and so create no closures). The fast paths use KEYS and ARGV
-- directly; the names of head.lua and the helpers of common.lua follow them.

-- Lua numbers are doubles; tostring would write large ones with an exponent.
local function int(n)
  return string.format('%d', n)
end

-- The next fencing token from the counter at `key`. A missing counter (a new name, or a
-- server that lost its data) starts from the server's clock in microseconds, so tokens
-- never go backwards after an empty restart as long as the server's clock does not.
local function next_token(key)
  local t = redis.call('INCR', key)
  if t == 1 then
    local now = redis.call('TIME')
    t = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', key, int(t))
  end
  return t
end
