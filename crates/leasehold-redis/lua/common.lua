-- leasehold: helpers shared by every script. Prepended to each script's body.
--
-- Keys of one lock name N (all share the hash tag {N}, so they live in one cluster slot):
local LOCK, XINFO = KEYS[1], KEYS[2]       -- exclusive holder: owner id (SET ... PX ttl); its "token|delay|value"
local READERS, RINFO = KEYS[3], KEYS[4]    -- shared holders: zset owner -> expiry (ms); hash owner -> info
local PERMITS, PINFO = KEYS[5], KEYS[6]    -- permit holders: zset owner -> expiry (ms); hash owner -> info
local TOKEN = KEYS[7]                      -- the fencing counter
local QUEUE, QEXP = KEYS[8], KEYS[9]       -- waiters: zset "<mode><owner>" -> arrival; zset same -> expiry (ms)
local DELAY, PDELAY = KEYS[10], KEYS[11]   -- lock-delay: zset owner -> end of its delay, per set
-- Common arguments:
local OWNER, MODE, TTL = ARGV[1], ARGV[2], tonumber(ARGV[3])
local LIMIT, CHANNEL = tonumber(ARGV[4]), ARGV[5]
local LOCK_DELAY = tonumber(ARGV[6])
-- MODE: 'x' exclusive, 's' shared, 'p' permit.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Lua numbers are doubles: format integers without an exponent.
local function int(n)
  return string.format('%.0f', n)
end

-- The next fencing token. A missing counter (a new name, or a server that lost its data)
-- starts from the server's clock in microseconds, so tokens never go backwards after an
-- empty restart as long as the server's clock does not.
local function next_token()
  local t = redis.call('INCR', TOKEN)
  if t == 1 then
    local now = redis.call('TIME')
    t = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', TOKEN, int(t))
  end
  return t
end

local function token_of(info)
  if not info then return 0 end
  return tonumber(string.match(info, '^(%d+)|')) or 0
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
-- of the queue by name, or everyone ('*') when no fair waiter is queued for the set.
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
local function check_foreign(holder)
  if holder and redis.call('PTTL', LOCK) == -1 then
    return redis.error_reply('LEASEHOLD_FOREIGN ' .. LOCK .. ' holds a value without an expiry; it was not written by leasehold')
  end
  return nil
end
