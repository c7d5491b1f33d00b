-- The ledger's invariants checked, and with repair rebuilt from the state hash, in one snapshot
-- (harvest.ops.ledgercheck). A spooled sample's owner and the ref to its row are in its state
-- value, or for a bare `s` (an older harvest's) in the spool_owner and spooled_payload hashes; an
-- entry there for any other sample is a stray, and so is a row in the hash for a sample whose
-- value holds its ref. Each job copy's counter of refs must be the refs held.
-- KEYS[1] = state
-- KEYS[2] = counts
-- KEYS[3] = failed
-- KEYS[4] = spool_owner
-- KEYS[5] = spooled_payload
-- KEYS[6] = spool_counts
-- ARGV[1] = repair: '1' to fix what disagrees
-- ARGV[2] = the failure JSON given to a failed sample without one
-- ARGV[3] = the job copies' key prefix (Keys.job_copy_prefix)
-- ARGV[4+] = the job ids of the job copies found
-- Returns a JSON document of what disagrees (each list holds up to 5 examples).
--! include lib/job_refs.lua
local repair, copies = ARGV[1] == '1', ARGV[3]
local recount, owned = {}, {}
local out = {counts = {}, failed_without_state = {}, failed_without_reason = {}, owner_without_spooled = {},
             spooled_without_owner = {}, payload_without_spooled = {}, spool_counts = {}, total = 0}
local n = {fws = 0, fwr = 0, ows = 0, swo = 0, pws = 0, jcr = 0}
local function note(list, key, id)
  n[key] = n[key] + 1
  if #list < 5 then list[#list + 1] = id end
end
local flat = redis.call('HGETALL', KEYS[1])
local state, bare, fused, held = {}, {}, {}, {}
local function hold(job) if job then held[job] = (held[job] or 0) + 1 end end
for i = 1, #flat, 2 do
  local id, v = flat[i], flat[i + 1]
  local s = letter(v)
  state[id] = s
  local ref = s == 's' and ref_in(v)
  if ref then fused[id] = true; hold(ref_job(ref)) end
  recount[s] = (recount[s] or 0) + 1
  out.total = out.total + 1
  if s == 'f' and redis.call('HEXISTS', KEYS[3], id) == 0 then
    note(out.failed_without_reason, 'fwr', id)
    if repair then redis.call('HSET', KEYS[3], id, ARGV[2]) end
  end
  if s == 's' then
    local o = owner_in(v)
    if o == nil then  -- a bare `s`: its owner is in the spool_owner hash
      bare[id] = true
      o = redis.call('HGET', KEYS[4], id)
      if not o then
        note(out.spooled_without_owner, 'swo', id)
        if repair then redis.call('HSET', KEYS[1], id, 's:') end
      end
    end
    if o and o ~= '' then owned[o] = (owned[o] or 0) + 1 end
  end
end
local function strays(key, list, nkey)
  local h = redis.call('HKEYS', key)
  for _, id in ipairs(h) do
    local fits = (nkey == 'fws' and state[id] == 'f') or (nkey == 'ows' and bare[id])
                 or (nkey == 'pws' and state[id] == 's' and not fused[id])
    if not fits then
      note(list, nkey, id)
      if repair then
        if key == KEYS[5] then drop_ref(copies, redis.call('HGET', key, id)) end
        redis.call('HDEL', key, id)
      end
    end
  end
end
strays(KEYS[3], out.failed_without_state, 'fws')
strays(KEYS[4], out.owner_without_spooled, 'ows')
strays(KEYS[5], out.payload_without_spooled, 'pws')
local rows = redis.call('HVALS', KEYS[5])  -- rows in full, and refs an older harvest kept here
for _, r in ipairs(rows) do hold(ref_job(r)) end
out.job_copies = {}
local found = {}
for i = 4, #ARGV do found[ARGV[i]] = true end
for job in pairs(held) do found[job] = true end
for job in pairs(found) do
  local copy = copies .. job
  local got = tonumber(redis.call('HGET', copy, 'harvest_refs')) or 0
  local want = held[job] or 0
  if want ~= got then
    out.job_copies[job] = {want, got}
    n.jcr = n.jcr + 1
    if repair and redis.call('EXISTS', copy) == 1 then  -- a copy that is gone cannot be made again
      if want > 0 then redis.call('HSET', copy, 'harvest_refs', want) else redis.call('DEL', copy) end
    end
  end
end
local counted = redis.call('HGETALL', KEYS[2])
local have = {}
for i = 1, #counted, 2 do have[counted[i]] = tonumber(counted[i + 1]) end
for _, s in ipairs({'q', 's', 'd', 'f'}) do
  local want, got = recount[s] or 0, have[s] or 0
  out.counts[s] = {want, got}
  if repair and want ~= got then redis.call('HSET', KEYS[2], s, want) end
end
local spools = redis.call('HGETALL', KEYS[6])
local seen = {}
for i = 1, #spools, 2 do
  local o, c = spools[i], tonumber(spools[i + 1])
  seen[o] = true
  if (owned[o] or 0) ~= c then
    out.spool_counts[o] = {owned[o] or 0, c}
    if repair then
      if (owned[o] or 0) > 0 then redis.call('HSET', KEYS[6], o, owned[o]) else redis.call('HDEL', KEYS[6], o) end
    end
  end
end
for o, c in pairs(owned) do
  if not seen[o] then
    out.spool_counts[o] = {c, 0}
    if repair then redis.call('HSET', KEYS[6], o, c) end
  end
end
out.n = n
return cjson.encode(out)
