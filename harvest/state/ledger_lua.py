"""The ledger's Lua: every move of sample states, with everything kept beside the states, in one
script call (harvest.state.ledger holds the contract; this module holds only the scripts, and
harvest.state.settle_lua the settle, a worker's job end and a shard's commit, built on `MOVE`).

Why the moves are batched inside the script. Redis runs scripts on its one thread, and each
`redis.call` costs about a microsecond of it. A move written per sample (read the state, write
it, bump two counters, look up and bump the owner's counter, ...) cost some 8 calls a sample, the
largest part of the control plane's Redis CPU (bench/fleet.py). Here a call reads the states of
up to `B` samples with one HMGET, writes them with one HSET, and the counters (per state, per
spool, per failure reason) are summed in Lua and written once per call. What the moves do is
unchanged: the same allowed sources, the same fences, the same side tables.

Keys of every script built on `MOVE` (in this order): state, counts, failed, spool_owner,
spooled_payload, spool_counts, revoked_spools, failed_reasons, failed_examples, failed_payload.

A state value is its letter, and a spooled sample's also names its owner and, where its row is
kept as a ref to a copy of its job (harvest.state.jobcopy), that ref: `s:<spool>` (`s:` for no
owner), `s:<spool>@<job id>#<index>`. They are read with the state and go with it, so moving a
sample into or out of s, and asking who owns it (the collector's view, the commit fence), touch
one hash field a sample, not three (bench/job_cost.py). A row kept in full (no job to copy) is in
the spooled_payload hash. A bare `s` was written by a harvest that kept owners in the spool_owner
hash and refs in the spooled_payload hash; they are read there, and leave as the sample moves on.

Every script that writes or drops a ref keeps the copy's counter of refs, and the last ref
deletes the copy.

Who owns a spooled sample, and what fences a late return: the spool its value names, until the
sample moves on (done, failed, reclaimed). A worker or collector of a spool the janitor revoked
(its node was silent past the grace) comes back to the same fences as before: a move to `s` for a
revoked spool is refused, and the collector's ownership test and commit fence
(harvest.state.ownership_lua) compare the owner in the value and refuse a revoked spool. A Redis
that forgets its last second forgets a move whole: the state, its owner and its ref are one field
written by one script with the counters and the job copy's ref count (one AOF entry), so they
cannot part; what a worker spooled meanwhile is taken up again by the ledger's absent -> s moves
and the collector (harvest.state.ledger.Ledger.mark_spooled).
"""

from __future__ import annotations

N_MOVE_KEYS = 10

# letter(v): the state letter of a state value ('_' absent). owner_in(v): the owner a spooled state
# value names ('' none); nil for a bare `s`, whose owner is in the spool_owner hash. ref_in(v): the
# ref a spooled state value holds (spool ids never hold an `@`: harvest.ids), nil if none.
# spooled_in(v): owner_in(v) and the job of its ref (nil if none), with one pattern match where the
# value holds a ref, not three (each match and its captures are the server's work, a sample each).
STATE_VALUE = """
local function letter(v) return v and string.sub(v, 1, 1) or '_' end
local function owner_in(v) if #v > 1 then return string.match(v, '^s:([^@]*)') end return nil end
local function ref_in(v) return v and string.match(v, '^s:[^@]*(@.+)$') end
local function spooled_in(v)
  local o, job = string.match(v, '^s:([^@]*)@([^#]+)#')
  if o then return o, job end
  return owner_in(v), nil
end
"""

# drop_ref(payload_key, row): a row leaving the spooled-payload hash `payload_key` gives back its
# ref, if it is one (`@<job id>#<index>`, harvest.state.jobcopy); the copy goes with its last ref.
DROP_REF = """
local function ref_job(row) return row and string.match(row, '^@([^#]+)#') end
local function add_refs(payload_key, job, d)
  local copy = payload_key .. ':' .. job
  if d > 0 and redis.call('EXISTS', copy) == 0 then
    redis.call('COPY', 'rq:job:' .. job, copy)
    redis.call('PERSIST', copy)
  end
  if redis.call('HINCRBY', copy, 'harvest_refs', d) <= 0 then redis.call('DEL', copy) end
end
local function drop_ref(payload_key, row)
  local job = ref_job(row)
  if job then add_refs(payload_key, job, -1) end
end
"""

# move(to, allowed, n, base, keep, ni, nr): the samples ARGV[base+1..base+n] move to `to` from any
# state letter in `allowed` ('_' = absent), except to s for a revoked spool. Their infos follow the
# ids, then their rows: `ni` infos and `nr` rows, each 0 (every one ''), 1 (one for all) or n (one a
# sample), so a value the samples share crosses into Lua once, not once a sample (an argument costs
# the server about what a hash field's read does: bench/job_cost.py). info: the failure JSON when
# moving to f, the owning spool id when moving to s, otherwise unread but for being set (the
# numbers a settle's segment sums are in its one info, read there: harvest.state.settle_lua). row:
# the payload row kept while spooled (to s), or kept as the failed payload (to f, when `keep`). Returns the moved ids in order; `finish()` writes the counters. An id listed twice
# moves once. The loop over the samples is the server's work a sample: its counts are kept in
# locals and summed once a call, not bumped through a function a sample.
MOVE = DROP_REF + STATE_VALUE + """
local B = 400
local dcount, dspool, dreason, leaving, examples, drefs = {}, {}, {}, {}, {}, {}
local revoked_cache, now = {}, {}
local function bump(t, k, v) t[k] = (t[k] or 0) + v end
local function revoked(spool)
  local r = revoked_cache[spool]
  if r == nil then
    r = redis.call('SISMEMBER', KEYS[7], spool) == 1
    revoked_cache[spool] = r
  end
  return r
end
local function failure(info)
  local ok, t = pcall(cjson.decode, info)
  if ok and type(t) == 'table' then
    return tostring(t.reason or '?'), tostring(t.message or '')
  end
  return '?', ''
end
local function hset(key, pairs) if #pairs > 0 then redis.call('HSET', key, unpack(pairs)) end end
local function hdel(key, ids) if #ids > 0 then redis.call('HDEL', key, unpack(ids)) end end
local function unref(ids)  -- the rows kept for `ids` are about to go: their refs with them
  if #ids == 0 then return end
  for _, r in ipairs(redis.call('HMGET', KEYS[5], unpack(ids))) do
    local job = ref_job(r)
    if job then bump(drefs, job, -1) end
  end
end
local function shared(at, k)  -- the value of a run of `k` values at ARGV[at+1..] that all samples share, or nil
  if k == 0 then return '' elseif k == 1 then return ARGV[at + 1] end
  return nil
end
local function move(to, allowed, n, base, keep, ni, nr)
  local changed = {}
  local from_ok = {}
  for k = 1, #allowed do from_ok[string.sub(allowed, k, k)] = true end
  from_ok[to] = nil
  local ib, rb = base + n, base + n + ni
  local ishared, rshared = shared(ib, ni), shared(rb, nr)
  local left, arrived = {}, 0  -- samples moved out of each state, and into `to`
  -- a job's samples come together: the prefix of the last ref (`@<job>#`) and spooled value
  -- (`s:<owner>@<job>#`) parsed, and what it held, so the next sample's is a plain comparison
  local rpre, rpjob, vpre, vpo, vpjob
  for lo = 1, n, B do
    local hi = math.min(n, lo + B - 1)
    local ids = {}
    for i = lo, hi do ids[#ids + 1] = ARGV[base + i] end
    local cur = redis.call('HMGET', KEYS[1], unpack(ids))
    local st, fl, row, kept, from_s, bare_s, from_f, stale = {}, {}, {}, {}, {}, {}, {}, {}
    for j = 1, #ids do
      local i = lo + j - 1
      local id = ids[j]
      local v = now[id]
      if v == nil then v = cur[j] end
      local c = v and string.sub(v, 1, 1) or '_'
      local info = from_ok[c] and (ishared or ARGV[ib + i])
      if info and not (to == 's' and info ~= '' and revoked(info)) then
        local r = rshared or ARGV[rb + i]
        local new, rjob = to, nil
        if to == 's' then
          if rpre and string.find(r, rpre, 1, true) == 1 then
            rjob = rpjob
          else
            rjob = ref_job(r)
            if rjob then rpre, rpjob = '@' .. rjob .. '#', rjob end
          end
          new = 's:' .. info .. (rjob and r or '')
        end
        now[id] = new
        st[#st + 1] = id; st[#st + 1] = new
        if c ~= '_' then left[c] = (left[c] or 0) + 1 end
        arrived = arrived + 1
        if c == 's' then
          local o, held
          if vpre and string.find(v, vpre, 1, true) == 1 then
            o, held = vpo, vpjob
          else
            o, held = spooled_in(v)
            if held then vpre, vpo, vpjob = 's:' .. o .. '@' .. held .. '#', o, held end
          end
          if o == nil then bare_s[#bare_s + 1] = id elseif o ~= '' then dspool[o] = (dspool[o] or 0) - 1 end
          if held then drefs[held] = (drefs[held] or 0) - 1 else from_s[#from_s + 1] = id end  -- else: a row in KEYS[5], if any
        end
        if c == 'f' then from_f[#from_f + 1] = id end
        if to == 'f' then
          fl[#fl + 1] = id; fl[#fl + 1] = info
          local reason, message = failure(info)
          bump(dreason, reason, 1)
          examples[reason] = id .. ': ' .. message  -- the latest failure of its reason
          if keep and r ~= '' then kept[#kept + 1] = id; kept[#kept + 1] = r end
        elseif to == 's' then
          if info ~= '' then dspool[info] = (dspool[info] or 0) + 1 end
          if rjob then
            drefs[rjob] = (drefs[rjob] or 0) + 1  -- kept in the state value
          elseif r ~= '' then
            row[#row + 1] = id; row[#row + 1] = r; stale[#stale + 1] = id
          end
        end
        changed[#changed + 1] = id
      end
    end
    if #bare_s > 0 then  -- owners kept by an older harvest in the spool_owner hash
      local owners = redis.call('HMGET', KEYS[4], unpack(bare_s))
      for j = 1, #bare_s do
        if owners[j] and owners[j] ~= '' then bump(dspool, owners[j], -1) end
      end
      hdel(KEYS[4], bare_s)
    end
    if #from_s > 0 then
      unref(from_s)
      hdel(KEYS[5], from_s)
    end
    if #from_f > 0 and to ~= 'f' then
      local old = redis.call('HMGET', KEYS[3], unpack(from_f))
      for j = 1, #from_f do
        if old[j] then bump(dreason, (failure(old[j])), -1) end
        leaving[from_f[j]] = true
      end
      hdel(KEYS[3], from_f)
    end
    hset(KEYS[1], st)
    hset(KEYS[3], fl)
    unref(stale)  -- a row left behind for a sample that was not spooled (repaired by harvest.ops.ledgercheck)
    hset(KEYS[5], row)
    hset(KEYS[10], kept)
  end
  for c, k in pairs(left) do bump(dcount, c, -k) end
  if arrived > 0 then bump(dcount, to, arrived) end
  return changed
end
local function finish()
  for job, d in pairs(drefs) do if d ~= 0 then add_refs(KEYS[5], job, d) end end
  for reason, ex in pairs(examples) do redis.call('HSET', KEYS[9], reason, ex) end
  for s, d in pairs(dcount) do if d ~= 0 then redis.call('HINCRBY', KEYS[2], s, d) end end
  for spool, d in pairs(dspool) do
    if d ~= 0 and redis.call('HINCRBY', KEYS[6], spool, d) <= 0 then redis.call('HDEL', KEYS[6], spool) end
  end
  for reason, d in pairs(dreason) do
    if d ~= 0 then
      local left = redis.call('HINCRBY', KEYS[8], reason, d)
      local ex = d < 0 and redis.call('HGET', KEYS[9], reason)
      if left <= 0 then
        redis.call('HDEL', KEYS[8], reason)
        redis.call('HDEL', KEYS[9], reason)
      elseif ex and leaving[string.match(ex, '^([^:]*)')] and not examples[reason] then
        redis.call('HDEL', KEYS[9], reason)  -- its example is no longer failed
      end
    end
  end
end
"""

# ARGV: to, allowed, keep ('1': a move to f keeps the rows as failed payloads), n, ni, nr, the n
# ids, the ni infos, the nr rows (`move`).
TRANSITION = MOVE + """
local changed = move(ARGV[1], ARGV[2], tonumber(ARGV[4]), 6, ARGV[3] == '1', tonumber(ARGV[5]), tonumber(ARGV[6]))
finish()
return changed
"""

# The producer's enqueue: absent -> q, and nothing else (`Ledger.add_queued`). `move` does it too,
# but its generality (owners, refs, failures, a value per sample parsed) costs the server about a
# microsecond a sample more than this loop (bench/job_cost.py, "producer: to queued"), and the text
# of the script is sent with each call (an EVAL in the producer's transaction: ledger
# `_in_transaction`), 7 KB where this is a few hundred bytes. KEYS: state, counts. ARGV: the ids.
# Returns the ids that did not move (known already): an id listed twice moves once.
ENQUEUE = """
local n, left, moved = 0, {}, {}
for lo = 1, #ARGV, 400 do
  local hi = math.min(#ARGV, lo + 399)
  local cur, st = redis.call('HMGET', KEYS[1], unpack(ARGV, lo, hi)), {}
  for j = 1, hi - lo + 1 do
    local id = ARGV[lo + j - 1]
    if moved[id] then  -- listed before, and moved then
    elseif cur[j] then left[#left + 1] = id
    else moved[id] = true; st[#st + 1] = id; st[#st + 1] = 'q'; n = n + 1 end
  end
  if #st > 0 then redis.call('HSET', KEYS[1], unpack(st)) end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'q', n) end
return left
"""

# Forget samples in one state (ARGV[1]): done ones no index in storage names (an index file lost),
# so the producer enqueues them again; queued ones a rerun's dataset no longer holds (--prune), so
# no worker extracts them (a job's worker takes only its queued samples). KEYS: state, counts.
# ARGV: the state letter, n, ids.
FORGET = """
local want, n = ARGV[1], tonumber(ARGV[2])
local gone = {}
for i = 1, n do
  local id = ARGV[2 + i]
  if redis.call('HGET', KEYS[1], id) == want then
    redis.call('HDEL', KEYS[1], id)
    redis.call('HINCRBY', KEYS[2], want, -1)
    gone[#gone + 1] = id
  end
end
return gone
"""
