-- leasehold: the fencing counter, included at a body's `-- @token` marker. CLOCK_FLOOR
-- (bound by the call: true for a single server, false for a Redlock node) says whether
-- tokens follow the server's clock.

-- The next fencing token from the counter at `key`: one above the last, and for a single
-- server never below the server's clock in milliseconds times 1 000. A counter that is
-- missing (an empty restart, FLUSHALL, eviction) or behind (a replica promoted before the
-- last grants reached it) so still hands out tokens above every earlier one, as long as this
-- server's clock is not behind the clock of the server that handed them out, and no name
-- was granted a thousand times within one millisecond. Only the first grant of a name in a
-- millisecond writes the clock; the others count up.
--
-- A Redlock node starts from its clock only when the counter is missing: the majority's
-- write-back orders the nodes' tokens, and clocks would set their counters apart on every
-- grant.
local function next_token(key)
  local t = redis.call('INCR', key)
  if CLOCK_FLOOR or t == 1 then
    local now = redis.call('TIME')
    local floor = tonumber(now[1]) * 1000000 + math.floor(tonumber(now[2]) / 1000) * 1000
    if t <= floor then
      t = floor + 1
      redis.call('SET', key, string.format('%d', t))
    end
  end
  return t
end
