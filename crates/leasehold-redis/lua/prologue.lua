-- leasehold: the helper every script needs, included at its `-- @prologue` marker, after
-- its fast path: the fast paths use KEYS and ARGV directly. The names of head.lua and the
-- helpers of common.lua follow.

-- Lua numbers are doubles; tostring would write large ones with an exponent.
local function int(n)
  return string.format('%d', n)
end
