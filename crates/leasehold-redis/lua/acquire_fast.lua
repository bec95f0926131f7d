-- acquire, the fast path: a call of its own (LOCK, TOKEN; OWNER, TTL and a Redlock
-- QUARANTINE), made for an exclusive request without a value or lock-delay on a name its
-- client is not waiting on already. Answers as acquire.lua does: the token; 0 if the name
-- is not simply free (the client makes the full call); busy during a Redlock quarantine.
-- @token
-- @quarantine

-- The next token, one SET NX of "<owner> <token>" with PX. The lock key is absent only if nobody
-- holds, reads, waits for or delays the name (see head.lua). If it is there, the token was
-- not handed out: take it back (the counter stays at or above where it stood before).
local token = next_token(TOKEN)
if redis.call('SET', LOCK, OWNER .. ' ' .. string.format('%d', token), 'NX', 'PX', TTL) then
  return token
end
redis.call('DECR', TOKEN)
return 0
