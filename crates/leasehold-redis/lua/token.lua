-- leasehold: the fencing counter, included at a body's `-- @token` marker. CLOCK_FLOOR
-- (bound by the call: true for a single server, false for a Redlock node) says whether
-- tokens follow the server's clock.

-- The next fencing token from the counter at `key`.
--
-- A single server's token is the server's clock in microseconds, or one above the last
-- token if that is not below it. A counter that is missing (an empty restart, FLUSHALL,
-- eviction) or behind (a replica promoted before the last grants reached it) so still hands
-- out tokens above every earlier one, as long as this server's clock is not behind the
-- clock of the server that handed them out.
--
-- A Redlock node counts one up, starting from its clock when the counter is missing: the
-- majority's write-back orders the nodes' tokens, and clocks would set their counters apart
-- on every grant.
local function next_token(key)
  if not CLOCK_FLOOR then
    local t = redis.call('INCR', key)
    if t == 1 then
      local now = redis.call('TIME')
      t = tonumber(now[1]) * 1000000 + tonumber(now[2])
      redis.call('SET', key, string.format('%d', t))
    end
    return t
  end
  local now = redis.call('TIME')
  local t = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local raw = redis.call('SET', key, string.format('%d', t), 'GET')
  local last = raw and tonumber(raw)
  if raw and not (last and last >= 0 and last < 2^53 and last == math.floor(last)) then
    -- Not a counter of ours (or one past what a Lua number counts exactly): put it back
    -- and refuse, as INCR would.
    redis.call('SET', key, raw)
    error(redis.error_reply('LEASEHOLD_FOREIGN ' .. key ..
      ' holds a value not written by leasehold (not a whole number below 2^53)'))
  end
  if last and last >= t then
    t = last + 1
    redis.call('SET', key, string.format('%d', t))
  end
  return t
end
