-- leasehold: helpers of the slower paths.
local CHANNEL = string.sub(LOCK, 1, -5) .. 'wake'

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The owner id and token of a lock value "<owner> <token>[ w]".
local function owner_of(value)
  if not value then return false end
  return string.match(value, '^(%S+) %d+')
end
local function token_in(value)
  return tonumber(string.match(value or '', '^%S+ (%d+)')) or 0
end
local function marked(value)
  return string.sub(value, -2) == ' w'
end
-- Whether a lock value is OWNER's (compared in place, as the fast paths do).
local function is_mine(value)
  return value and string.find(value, OWNER, 1, true) == 1 and string.byte(value, #OWNER + 1) == 32
end

-- Info of a shared or permit holder: "token|value".
local function info_of(token)
  return int(token) .. '|' .. VALUE
end
local function token_of(info)
  return tonumber(string.match(info or '', '^(%d+)|')) or 0
end

-- Keeps the gate (see head.lua) up until at least `at` (ms).
local function hold_gate(at)
  if redis.call('PEXPIRETIME', GATE) < at then
    redis.call('SET', GATE, '1', 'PXAT', int(at))
  end
end

-- Drops the gate once nothing it guards is left (called after removing holders or waiters;
-- a call without every key leaves it to expire, or to the next call that has them).
local function close_gate_if_idle()
  if #KEYS == 12 and redis.call('EXISTS', READERS, QUEUE, DELAY) == 0 then
    redis.call('DEL', GATE)
  end
end

-- Writes until when `owner` holds, or is delayed, in a holder zset or lock-delay zset; the
-- entries of exclusive and shared holders keep the gate up (permits are not gated).
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

-- Keeps a holder zset and its info hash alive exactly as long as their last member.
local function extend_set(zset, info)
  local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  if #last > 0 then
    redis.call('PEXPIREAT', zset, last[2])
    redis.call('PEXPIREAT', info, last[2])
  end
end

-- Tells waiters that they may try again: the owners of the compatible group at the head
-- of the fair queue by name, or everyone ('*') when no fair waiter is queued for the set.
local function wake_next(permits, limit)
  local names = {}
  local members = redis.call('ZRANGE', QUEUE, 0, -1)
  if permits then
    local free = limit - redis.call('ZCARD', PERMITS)
    for _, m in ipairs(members) do
      if free <= 0 then break end
      if string.sub(m, 1, 1) == 'p' then
        table.insert(names, string.sub(m, 2))
        free = free - 1
      end
    end
  else
    for _, m in ipairs(members) do
      local kind = string.sub(m, 1, 1)
      if kind == 'x' then
        if #names == 0 then table.insert(names, string.sub(m, 2)) end
        break
      elseif kind == 's' then
        table.insert(names, string.sub(m, 2))
      end
    end
  end
  if #names == 0 then
    redis.call('PUBLISH', CHANNEL, '*')
  else
    redis.call('PUBLISH', CHANNEL, table.concat(names, ' '))
  end
end

-- A lock key that never expires was not written by leasehold: refuse to guess.
local function check_foreign(value)
  if value and (redis.call('PTTL', LOCK) == -1 or not owner_of(value)) then
    return redis.error_reply('LEASEHOLD_FOREIGN ' .. LOCK .. ' holds a value not written by leasehold (no expiry, or not "<owner> <token>")')
  end
  return nil
end
