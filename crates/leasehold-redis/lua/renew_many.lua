-- renew_many: renew.lua's fast path for many exclusive grants at once, one call per batch.
-- KEYS[i] is a lock key; ARGV[2i-1] and ARGV[2i] are its owner and lease (ms). Only
-- grants without a lock-delay or a stored value are passed, whose lease is the key's
-- expiry (see head.lua). The one script not of a fixed shape (src/script.rs).
--
-- Answers, one per key: 1 extended, 0 not the owner's (any more), 2 a lease written in
-- the value ("<owner> w<until> <token>": waiters are about), which takes renew.lua.
local answers = {}
for i = 1, #KEYS do
  local owner = ARGV[2 * i - 1]
  local value = redis.call('GET', KEYS[i])
  if not value or string.find(value, owner, 1, true) ~= 1 or string.byte(value, #owner + 1) ~= 32 then
    answers[i] = 0
  elseif string.byte(value, #owner + 2) == 119 then
    answers[i] = 2
  else
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    answers[i] = 1
  end
end
return answers
