-- leasehold: helpers of the slower paths. Wake-ups are published on CHANNEL.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The server's time in µs (a double holds it exactly).
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The lock value of nobody (see head.lua); '*' is not allowed in owner ids.
local GATE_ONLY = '* w0 0'

-- The owner, token and lease end (false: the key's expiry) of a lock value, or nil if it
-- is not one.
local function parse_lock(value)
  if not value then return nil end
  local owner, token = string.match(value, '^(%S+) (%d+)$')
  if owner then return owner, tonumber(token), false end
  local ends
  owner, ends, token = string.match(value, '^(%S+) w(%d+) (%d+)$')
  if owner then return owner, tonumber(token), tonumber(ends) end
  return nil
end

-- The exclusive holder in a lock value at `now` (owner and token), or false.
local function live_holder(value, now)
  local owner, token, ends = parse_lock(value)
  if owner and (not ends or ends > now) then return owner, token end
  return false
end

-- The gate a release leaves for the waiters it wakes: nobody's value, with the release's
-- server time in µs where a holder's value has its token. The grant that follows answers
-- how long the name stood released: the hand-off (acquire.lua).
local function released_gate()
  return '* w0 ' .. int(now_us())
end

-- Marks the gate with a release's time once no reader is left (an exclusive waiter goes
-- only then), or, not `released`, takes the time off: a shared grant ends the hand-off.
local function mark_gate(released)
  local value = redis.call('GET', LOCK)
  if parse_lock(value) ~= '*' then return end
  if released then
    if redis.call('EXISTS', READERS) == 0 then
      redis.call('SET', LOCK, released_gate(), 'KEEPTTL')
    end
  elseif value ~= GATE_ONLY then
    redis.call('SET', LOCK, GATE_ONLY, 'KEEPTTL')
  end
end

-- The µs from a released gate's time to now, or false if `value` is not such a gate.
local function since_release(value)
  local owner, released = parse_lock(value)
  if owner ~= '*' or not released or released == 0 then return false end
  return math.max(now_us() - released, 0)
end

-- Whether OWNER's grant in MODE is live at `now`: for the lock set the exclusive holder in
-- the lock value (whose lease may end before the key does), else an entry of the mode's
-- holder zset whose lease (its score) has not ended.
local function holds_grant(now)
  if MODE == 'x' then return live_holder(redis.call('GET', LOCK), now) == OWNER end
  local zset = READERS
  if MODE == 'p' then zset = PERMITS end
  local ends = tonumber(redis.call('ZSCORE', zset, OWNER))
  return ends ~= nil and ends > now
end

-- The lock value of a holder: with its lease end `ends` (ms) when the key may outlive it.
local function lock_value(owner, token, ends)
  if ends then return owner .. ' w' .. int(ends) .. ' ' .. int(token) end
  return owner .. ' ' .. int(token)
end

-- Info of a shared holder: "token|value"; of a permit holder "token/limit|value", since
-- each permit counts with its own limit.
local function info_of(token)
  if MODE == 'p' then return int(token) .. '/' .. int(LIMIT) .. '|' .. VALUE end
  return int(token) .. '|' .. VALUE
end
local function token_of(info)
  return tonumber(string.match(info or '', '^(%d+)[/|]')) or 0
end

-- Keeps the lock key up as the gate (see head.lua) until at least `at` (ms). A holder's
-- value is rewritten with its own lease end first, so the gate never lengthens a lease.
local function hold_gate(at)
  local value = redis.call('GET', LOCK)
  if not value then
    redis.call('SET', LOCK, GATE_ONLY, 'PXAT', int(at))
    return
  end
  local owner, token, ends = parse_lock(value)
  if not owner then return end -- not leasehold's: check_foreign reports it
  local expires = redis.call('PEXPIRETIME', LOCK)
  if not ends then
    redis.call('SET', LOCK, lock_value(owner, token, expires), 'KEEPTTL')
  end
  if expires < at then redis.call('PEXPIREAT', LOCK, int(at)) end
end

-- Extends the lease of the exclusive holder in `value` to now + ttl.
local function extend_holder(value, now, ttl)
  local owner, token, ends = parse_lock(value)
  if not ends then
    redis.call('PEXPIRE', LOCK, ttl)
    return
  end
  redis.call('SET', LOCK, lock_value(owner, token, now + ttl), 'KEEPTTL')
  if redis.call('PEXPIRETIME', LOCK) < now + ttl then redis.call('PEXPIREAT', LOCK, int(now + ttl)) end
end

-- Writes until when `owner` holds, or is delayed, in a holder zset or lock-delay zset; the
-- entries of exclusive and shared holders keep the gate up (permits do not need it).
local function hold(zset, at, owner)
  redis.call('ZADD', zset, at, owner)
  if zset ~= PERMITS and zset ~= PDELAY then hold_gate(at) end
end

-- Drops expired members of a holder zset and their info.
local function prune_holders(zset, info, now)
  local gone = redis.call('ZRANGEBYSCORE', zset, '-inf', now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', zset, '-inf', now)
    redis.call('HDEL', info, unpack(gone))
  end
end

-- Drops expired waiter entries.
local function prune_queue(now)
  local gone = redis.call('ZRANGEBYSCORE', QEXP, '-inf', now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', QEXP, '-inf', now)
    redis.call('ZREM', QUEUE, unpack(gone))
  end
end

local function prune_all(now)
  prune_holders(READERS, RINFO, now)
  prune_holders(PERMITS, PINFO, now)
  prune_queue(now)
  redis.call('ZREMRANGEBYSCORE', DELAY, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', PDELAY, '-inf', now)
end

-- Drops the lock key once it is only a gate with nothing left behind it: no live holder,
-- waiter, reader or lock-delay. (A call without every key leaves it to expire.)
local function close_gate_if_idle(now)
  if not PDELAY then return end
  local value = redis.call('GET', LOCK)
  if not value or not parse_lock(value) or live_holder(value, now) then return end
  prune_all(now)
  if redis.call('EXISTS', READERS, QEXP, DELAY) == 0 then redis.call('DEL', LOCK) end
end

-- Keeps a holder zset and its info hash alive exactly as long as their last member.
local function extend_set(zset, info)
  local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  if #last > 0 then
    redis.call('PEXPIREAT', zset, last[2])
    redis.call('PEXPIREAT', info, last[2])
  end
end

-- A waiter's member of the fair queue (and of QEXP): "<mode><owner>", a permit's with
-- "/<limit>" after it, since each permit request counts with its own limit ('/' is not
-- allowed in owner ids). An exclusive waiter a release may hand the lock to is
-- "h<owner>" instead (acquire.lua).
local function member_of(mode, owner, limit)
  if mode == 'p' then return 'p' .. owner .. '/' .. int(limit) end
  return mode .. owner
end
-- The owner and the limit of a permit waiter's member (nil if it is not one).
local function permit_of(member)
  local owner, limit = string.match(member, '^p(.+)/(%d+)$')
  return owner, tonumber(limit)
end

-- Tells waiters that they may try again: the owners of the compatible group at the head
-- of the fair queue by name (permits in queue order while each fits: fewer held and
-- queued before it than its own limit), or everyone ('*') when no fair waiter is queued
-- for the set.
local function wake_next(permits)
  local names = {}
  local members = redis.call('ZRANGE', QUEUE, 0, -1)
  if permits then
    local before = redis.call('ZCARD', PERMITS)
    for _, m in ipairs(members) do
      if string.sub(m, 1, 1) == 'p' then
        local owner, limit = permit_of(m)
        if not owner or before >= limit then break end
        table.insert(names, owner)
        before = before + 1
      end
    end
  else
    for _, m in ipairs(members) do
      local kind = string.sub(m, 1, 1)
      if kind == 'x' or kind == 'h' then
        if #names == 0 then table.insert(names, string.sub(m, 2)) end
        break
      elseif kind == 's' then
        table.insert(names, string.sub(m, 2))
      end
    end
  end
  if #names == 0 then
    redis.call(PUBLISH, CHANNEL, '*')
  else
    redis.call(PUBLISH, CHANNEL, table.concat(names, ' '))
  end
end

-- A lock key that never expires was not written by leasehold: refuse to guess.
local function check_foreign(value)
  if value and (redis.call('PTTL', LOCK) == -1 or not parse_lock(value)) then
    return redis.error_reply('LEASEHOLD_FOREIGN ' .. LOCK .. ' holds a value not written by leasehold (no expiry, or not "<owner> [w<until> ]<token>")')
  end
  return nil
end
