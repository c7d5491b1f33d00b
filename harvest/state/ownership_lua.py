"""The ledger's scripts that ask who owns a spooled sample: the ownership test of a shard's
samples (its packing record and its commit fence) and the janitor's reclaim of a revoked spool's
samples. (The collector's view of its spool files decides nothing, and is a plain read:
harvest.state.ledger.Ledger.states_and_owners.) The owner is read from the sample's state
value (`s:<spool>`), or for a bare `s` an older harvest wrote, from the spool_owner hash
(harvest.state.ledger_lua holds the value's format and the moves that write it).
"""

from __future__ import annotations

from harvest.state.ledger_lua import DROP_REF, STATE_VALUE

# Reclaim: s -> q for the samples a (revoked) spool still owns. KEYS as the moves'; ARGV: spool, n, ids.
RECLAIM = DROP_REF + STATE_VALUE + """
local spool, n = ARGV[1], tonumber(ARGV[2])
local moved = {}
for i = 1, n do
  local id = ARGV[2 + i]
  local v = redis.call('HGET', KEYS[1], id)
  local owner = letter(v) == 's' and (owner_in(v) or redis.call('HGET', KEYS[4], id))
  if owner == spool then
    redis.call('HSET', KEYS[1], id, 'q')
    redis.call('HINCRBY', KEYS[2], 's', -1)
    redis.call('HINCRBY', KEYS[2], 'q', 1)
    redis.call('HDEL', KEYS[4], id)
    local held = ref_in(v)
    if held then drop_ref(KEYS[5], held) end
    drop_ref(KEYS[5], redis.call('HGET', KEYS[5], id))
    redis.call('HDEL', KEYS[5], id)
    if redis.call('HINCRBY', KEYS[6], spool, -1) <= 0 then redis.call('HDEL', KEYS[6], spool) end
    moved[#moved + 1] = id
  end
end
return moved
"""

# owns(spool, base, n): whether `spool` is not revoked and owns every one of ARGV[base+1..base+n]
# in state s (or they have no owner: spooled without one, which no reclaim can take). KEYS: state,
# spool_owner, revoked_spools, as the commit fence's. A value that names `spool` is told by a plain
# prefix test (`s:<spool>@`, or the whole value `s:<spool>`), not a pattern match a sample: the
# match and its capture were most of the fence's own cost (bench/job_cost.py, "collector: fence").
OWNS = STATE_VALUE + """
local function owns(spool, base, n)
  if redis.call('SISMEMBER', KEYS[3], spool) == 1 then return false end
  local mine, whole = 's:' .. spool .. '@', 's:' .. spool
  for lo = 1, n, 400 do
    local ids, bare = {}, {}
    for i = lo, math.min(n, lo + 399) do ids[#ids + 1] = ARGV[base + i] end
    local st = redis.call('HMGET', KEYS[1], unpack(ids))
    for j = 1, #ids do
      local v = st[j]
      if not (v and (string.find(v, mine, 1, true) == 1 or v == whole)) then
        if letter(v) ~= 's' then return false end
        local o = owner_in(v)
        if o == nil then bare[#bare + 1] = ids[j] elseif o ~= '' then return false end
      end
    end
    if #bare > 0 then
      for _, o in ipairs(redis.call('HMGET', KEYS[2], unpack(bare))) do
        if o and o ~= '' and o ~= spool then return false end
      end
    end
  end
  return true
end
"""

# The commit fence. KEYS: state, spool_owner, revoked_spools, the packing record. ARGV: spool,
# record JSON (with the shard's index document), the record as the collector wrote it before
# packing, n, ids. Writes the record only when
# the spool is not revoked, every sample is in state s, owned by it (or by no spool: spooled
# without an owner, which no reclaim can take), and the record is still the one the collector
# wrote: a Redis that forgot the record (a rollback, a failover) forgot who is packing the shard,
# and a claim in storage naming it may then be taken over (harvest.formats.claims), so the shard
# must not be committed.
FENCE = OWNS + """
local spool, record, before, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local held = redis.call('GET', KEYS[4])  -- read once: nothing below writes it before the SET
-- already fenced with this very record: a retry whose first reply was lost (harvest.state.connection)
if record ~= '' and held == record then return 1 end
if not owns(spool, 4, n) then return 0 end
if held ~= before then return 0 end
redis.call('SET', KEYS[4], record)
return 1
"""
