-- release: remove OWNER's grant, or its waiter entry; nothing of anyone else's. Wakes the
-- waiters that may now be granted, or hands an exclusive grant straight to the next
-- (`hand_over`). Returns 1 if something was removed, else 0.
-- With a PLACE (a Redlock node's waiter giving back a grant that made no majority), the
-- grant goes back to the queue: OWNER waits again at PLACE, until its grant would have
-- ended, so that the nodes' queues still agree; a waiter entry is kept as it is.

-- An exclusive holder whose lease is the key's (nobody waits; see head.lua): compare the
-- owner without building a string, then DEL the lock, its stored value (XINFO, when the
-- call passes it) and its lock-delay entry (DELAY, likewise). An exclusive release passes
-- no FLAGS (they default to 'x').
-- A value of OWNER's that carries a lease end goes on to the slower path below, as `mine`.
local mine = false
if string.byte(FLAGS) == 120 then -- 'x'
  local value = redis.call('GET', LOCK)
  if value and string.find(value, OWNER, 1, true) == 1 and string.byte(value, #OWNER + 1) == 32 then
    -- not "<owner> w<until> <token>", and not going back to the queue
    if string.byte(value, #OWNER + 2) ~= 119 and PLACE == '0' then
      if XINFO then
        -- A grant with a value (an election's leader): its observers see it go.
        redis.call('DEL', LOCK, XINFO)
        redis.call(PUBLISH, CHANNEL, '*')
      else
        redis.call('DEL', LOCK)
      end
      if DELAY then redis.call('ZREM', DELAY, OWNER) end
      return 1
    end
    mine = value
  end
end

-- @token
-- @prologue
-- @head
-- @common

local now = now_ms()
-- Back to the queue at PLACE, until `ends` (ms): the key stays up as the gate till then.
-- The place is the one the waiter still has on the nodes that did not grant: when its
-- acquisition began (acquire.lua brought it within a lease of the clock only if the
-- client's clock was that far off).
local function requeue(ends)
  local me = member_of(MODE, OWNER, LIMIT)
  redis.call('ZADD', QUEUE, PLACE, me)
  redis.call('ZADD', QEXP, ends, me)
  hold_gate(ends)
end
-- Hands the lock straight to the waiter at the head of the queue if a release may grant it
-- ("h<owner>": exclusive, nothing to store at its grant), as its own acquire would on being
-- woken: a fresh token, and a lease that ends with its waiter entry (the lease of its last
-- request). The wake-up tells it "<owner>!<token>" (src/wakeups.rs); others wait on. Not
-- while a lock-delay of another owner keeps the name closed (OWNER's own ends with its
-- release; the others' were all over when OWNER was granted, and no new one is made while
-- it holds, so a call that passes no DELAY has none to look at).
local function hand_over()
  local head = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  if not head or string.byte(head) ~= 104 then return false end -- 'h'
  local ends = tonumber(redis.call('ZSCORE', QEXP, head))
  if not ends or ends <= now then return false end
  if DELAY then
    redis.call('ZREM', DELAY, OWNER)
    redis.call('ZREMRANGEBYSCORE', DELAY, '-inf', now)
    if redis.call('EXISTS', DELAY) == 1 then return false end
  end
  redis.call('ZREM', QUEUE, head)
  redis.call('ZREM', QEXP, head)
  local owner = string.sub(head, 2)
  local token = next_token(TOKEN)
  redis.call('SET', LOCK, lock_value(owner, token, false), 'PXAT', int(ends))
  local last = redis.call('ZRANGE', QEXP, -1, -1, 'WITHSCORES')
  if #last > 0 then hold_gate(tonumber(last[2])) end
  redis.call(PUBLISH, CHANNEL, owner .. '!' .. int(token))
  return true
end
-- OWNER's value with a lease end: released if the lease has not ended. The key stays as
-- the gate while others wait (or delay the name); woken, they go on in queue order.
if mine and live_holder(mine, now) then
  if XINFO then redis.call('DEL', XINFO) end
  prune_queue(now)
  if PLACE ~= '0' then
    local _, _, ends = parse_lock(mine)
    requeue(ends or now + redis.call('PTTL', LOCK))
  elseif hand_over() then
    return 1
  end
  local others = redis.call('EXISTS', QEXP)
  if DELAY then
    redis.call('ZREM', DELAY, OWNER)
    redis.call('ZREMRANGEBYSCORE', DELAY, '-inf', now)
    others = others + redis.call('EXISTS', DELAY)
  end
  if others == 0 then
    redis.call('DEL', LOCK)
  else
    redis.call('SET', LOCK, released_gate(), 'KEEPTTL')
  end
  wake_next(false)
  return 1
end
if MODE ~= 'x' then
  local zset, info, delay = READERS, RINFO, DELAY
  if MODE == 'p' then zset, info, delay = PERMITS, PINFO, PDELAY end
  local expires = redis.call('ZSCORE', zset, OWNER)
  if expires then
    redis.call('ZREM', zset, OWNER)
    redis.call('HDEL', info, OWNER)
    redis.call('ZREM', delay, OWNER)
    if PLACE ~= '0' and tonumber(expires) > now then requeue(tonumber(expires)) end
    close_gate_if_idle(now)
    if tonumber(expires) > now then
      if MODE == 's' then mark_gate(true) end
      prune_queue(now)
      wake_next(MODE == 'p')
      return 1
    end
    return 0
  end
end
if PLACE ~= '0' then return 0 end
local me = member_of(MODE, OWNER, LIMIT)
-- An exclusive waiter's entry may be either kind (acquire.lua).
local handed_to = me
if MODE == 'x' then handed_to = 'h' .. OWNER end
local gone = redis.call('ZREM', QEXP, me, '~' .. me, handed_to)
if redis.call('ZREM', QUEUE, me, handed_to) > 0 or gone > 0 then
  prune_queue(now)
  close_gate_if_idle(now)
  -- If it was at the head, whoever is next may now go first.
  wake_next(MODE == 'p')
  return 1
end
return 0
