-- leasehold: what the slower paths derive from the arguments. Before a script's body come
-- the names of the keys and arguments its call passes, generated from the call's shape
-- (src/script.rs): a key the call does not pass is nil, an argument its default.
--
-- Keys of one lock name N all share the hash tag {N}, so they live in one cluster slot.
-- The lock key (LOCK) is also the gate: it exists while anyone holds the lock, reads, waits
-- for it (a live waiter entry) or delays it (a live lock-delay entry, also the one that
-- keeps it closed after a force release: evict.lua). So SET NX of the lock key is all the
-- acquire fast path needs. Its value is one of:
--   "<owner> <token>"           a holder whose lease is the key's expiry, with nobody
--                               waiting: its release is a plain compare-and-delete;
--   "<owner> w<until> <token>"  a holder whose lease ends at <until> (ms, server time)
--                               while the key may live on for others: its release wakes
--                               waiters and leaves the key as a gate if they remain;
--   GATE_ONLY                   nobody holds; the key only keeps the fast path shut;
--   "* w0 <µs>"                 the same, left by a release that woke waiters, with its
--                               server time (the next grant answers the hand-off).
local MODE = string.sub(FLAGS, 1, 1)
local FAIR = string.sub(FLAGS, 2, 2) == '1'
local WAITING = string.sub(FLAGS, 3, 3) == '1'
local HAS_VALUE = string.sub(FLAGS, 4, 4) == '1'
local FRESH_TOKEN = string.sub(FLAGS, 5, 5) == '1'
LIMIT, LOCK_DELAY = tonumber(LIMIT), tonumber(LOCK_DELAY)
