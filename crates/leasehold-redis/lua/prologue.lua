-- leasehold: the helper every slower path needs, included at a body's `-- @prologue`
-- marker, after its fast path. The values of head.lua and the helpers of common.lua follow.

-- Lua numbers are doubles; tostring would write large ones with an exponent.
local function int(n)
  return string.format('%d', n)
end
