-- leasehold: the Redlock restart quarantine, included at a body's `-- @quarantine` marker.
-- A node that restarted less than QUARANTINE ms ago refuses grants, so that every lock it
-- may have forgotten (an empty restart, or a snapshot older than the last grants) has
-- expired on the other nodes first. Busy, with when to try again (see acquire.lua).
-- `uptime_in_seconds` is the difference of two truncated wall-clock seconds: it reads 1 as
-- soon as the second ticks over after the start, however short the uptime. Less one second,
-- it never overstates the uptime.
if QUARANTINE ~= '0' then
  local info = redis.call('INFO', 'server')
  local up = (tonumber(string.match(info, 'uptime_in_seconds:(%d+)') or '0') - 1) * 1000
  local quarantine = tonumber(QUARANTINE)
  if up < quarantine then return -(quarantine - up + 2) end
end
