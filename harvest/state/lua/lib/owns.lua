--! include lib/state_value.lua
-- The ownership test of a shard's samples (the commit fence and the packing record).

-- owns(state_key, owner_key, revoked_key, spool, ids, base, n): whether `spool` is not revoked
-- (in the set `revoked_key`) and owns every one of ids[base+1..base+n] in state s, or they have
-- no owner (spooled without one, which no reclaim can take). state_key: the state hash;
-- owner_key: the spool_owner hash, where a bare `s` keeps its owner. A value that names `spool`
-- is told by a plain prefix test (`s:<spool>@`, or the whole value `s:<spool>`), not a pattern
-- match a sample: the match and its capture were most of the fence's own cost.
local function owns(state_key, owner_key, revoked_key, spool, ids, base, n)
  if redis.call('SISMEMBER', revoked_key, spool) == 1 then return false end
  local mine, whole = 's:' .. spool .. '@', 's:' .. spool
  for lo = 1, n, 400 do
    local some, bare = {}, {}
    for i = lo, math.min(n, lo + 399) do some[#some + 1] = ids[base + i] end
    local st = redis.call('HMGET', state_key, unpack(some))
    for j = 1, #some do
      local v = st[j]
      if not (v and (string.find(v, mine, 1, true) == 1 or v == whole)) then
        if letter(v) ~= 's' then return false end
        local o = owner_in(v)
        if o == nil then bare[#bare + 1] = some[j] elseif o ~= '' then return false end
      end
    end
    if #bare > 0 then
      for _, o in ipairs(redis.call('HMGET', owner_key, unpack(bare))) do
        if o and o ~= '' and o ~= spool then return false end
      end
    end
  end
  return true
end
