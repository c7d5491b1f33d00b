"""The settle: several ledger moves and the run's stats in one script call, the call a worker makes
at a job's end and a collector at a shard's commit (harvest.state.ledger holds the contract;
harvest.state.ledger_lua the general move and the state values' format, unchanged here).

Why a module of its own: these two calls are each sample's cost to a fleet's one Redis
(bench/fleet.py, bench/job_cost.py), so their common cases have moves of their own (`HOT_MOVES`),
which write what the general move would, and fall back to it for everything else. Who owns a
sample and what fences a late return are the general move's (harvest.state.ledger_lua): a
revoked spool's move to s is refused, and the writes of one call are one AOF entry.
"""

from __future__ import annotations

from typing import NamedTuple

from harvest.state.ledger_lua import MOVE


class Segment(NamedTuple):
    """One move of a settle call, as `SETTLE` reads it (its ARGV layout is below)."""

    to: str
    allowed: str
    keep: bool
    count: str  # the stats field counting the moved samples ('' none)
    total: str  # the stats field summing their numbers, given in the one info ('' none)
    job: str  # a worker job's spool: the rows are indexes into this job ('' none)
    ids: list[str]
    infos: list[str]
    rows: list[str]

# The rate bucket the stats of this call go to: by the server's TIME, so every node's stats land
# in the buckets `Ledger.rates` reads, whatever the node's clock says. Redis 7 replicates a
# script's effects, so a script may read TIME before it writes. prefix: Keys.rate_prefix.
RATE_KEY = """
local function rate_key(prefix, bucket_s)
  local t = redis.call('TIME')
  return prefix .. math.floor(tonumber(t[1]) / bucket_s)
end
"""

# The two moves every sample makes, each a call's whole work in a fleet: its job's spool (q -> s)
# and its shard's commit (s -> d). `move` does both, but its generality (any source state, an owner
# and a ref parsed a sample, the side hashes of older values, failures) and a settle's check of
# each row cost the server 1-2 µs a sample more in each (bench/job_cost.py), the largest part of a
# saturated Redis's cost a sample (bench/fleet.py). These do the same writes, counted in the same
# tables for `finish()`, for the forms a fleet's samples have:
# spool_job(n, base, owner, job, rb): the samples ARGV[base+1..base+n], queued or absent, to
# `s:<owner>@<job>#<index>`, their indexes ARGV[rb+1..rb+n] (the ref `move` would write for a row
# `@<job>#<index>`); none for a revoked owner. An id listed twice moves once.
# commit_shard(n, base): the samples ARGV[base+1..base+n] to d, where each is done already or
# spooled with a ref (`s:<owner>@<job>#<i>`); nil, having written nothing, where any is not (queued,
# absent, failed, spooled with its row kept in full or by an older harvest): `move` does those.
# Both return the moved ids in order.
HOT_MOVES = """
local function spool_job(n, base, owner, job, rb)
  if owner ~= '' and revoked(owner) then return {} end
  local pre, changed, seen, nq = 's:' .. owner .. '@' .. job .. '#', {}, {}, 0
  for lo = 1, n, B do
    local hi = math.min(n, lo + B - 1)
    local cur, st = redis.call('HMGET', KEYS[1], unpack(ARGV, base + lo, base + hi)), {}
    for i = lo, hi do
      local v, id = cur[i - lo + 1], ARGV[base + i]
      if (not v or v == 'q') and not seen[id] then
        seen[id] = true
        if v then nq = nq + 1 end
        st[#st + 1] = id; st[#st + 1] = pre .. ARGV[rb + i]
        changed[#changed + 1] = id
      end
    end
    hset(KEYS[1], st)
  end
  local k = #changed
  if k > 0 then
    bump(dcount, 'q', -nq); bump(dcount, 's', k)
    if owner ~= '' then bump(dspool, owner, k) end
    bump(drefs, job, k)
  end
  return changed
end
local function commit_shard(n, base)
  local st, changed, seen, owners, jobs = {}, {}, {}, {}, {}
  local vpre, vo, vjob  -- the prefix `s:<owner>@<job>#` of the last value parsed, and its parts
  for lo = 1, n, B do
    local hi = math.min(n, lo + B - 1)
    local cur = redis.call('HMGET', KEYS[1], unpack(ARGV, base + lo, base + hi))
    for i = lo, hi do
      local v, id = cur[i - lo + 1], ARGV[base + i]
      if v ~= 'd' and not seen[id] then
        if not (vpre and v and string.find(v, vpre, 1, true) == 1) then
          local o, job = string.match(v or '', '^s:([^@]*)@([^#]+)#')
          if not o then return nil end
          vpre, vo, vjob = 's:' .. o .. '@' .. job .. '#', o, job
        end
        seen[id] = true
        st[#st + 1] = id; st[#st + 1] = 'd'
        changed[#changed + 1] = id
        if vo ~= '' then owners[vo] = (owners[vo] or 0) + 1 end
        jobs[vjob] = (jobs[vjob] or 0) + 1
      end
    end
  end
  for lo = 1, #st, 2 * B do redis.call('HSET', KEYS[1], unpack(st, lo, math.min(#st, lo + 2 * B - 1))) end
  if #changed > 0 then bump(dcount, 's', -#changed); bump(dcount, 'd', #changed) end
  for o, k in pairs(owners) do bump(dspool, o, -k) end
  for job, k in pairs(jobs) do bump(drefs, job, -k) end
  return changed
end
"""

# Several moves and the run's stats in one call: a worker's job (its spooled and its failed
# samples, the failures counted), a collector's shard (done; reconcile's with its count). The
# throughput stats of workers and collectors go at their heartbeats instead (harvest.state.tally). KEYS: the 10 move keys,
# stats, then the keys a record's end names. ARGV: bucket ttl, rate key prefix, bucket seconds,
# segments; per segment: to, allowed, keep, count field ('' none), sum field ('' none; else the
# segment's one info holds the numbers it sums over the moved samples, as below), job ('' none;
# else the segment is a worker job's spool, q or absent -> s, whose rows are the samples' indexes in
# that job: `spool_job`), n, ni, nr, the n ids, the ni infos, the nr rows (`move`); then the number
# of stat pairs and (field, increment) pairs; then, optionally, the key indexes of a record to
# delete and of the set to remove it from. Returns per segment the moved ids, or their number
# where every id listed moved (then none was listed twice).
SETTLE = MOVE + RATE_KEY + HOT_MOVES + """
local stats = {}
local p = 4
local nseg = tonumber(ARGV[p]); p = p + 1
-- Every job a row to spool refers to is still there to copy (or copied), before anything moves.
local q, seen, last = p, {}, nil  -- last: `@<job>#` of the job checked last (a job's rows come together)
local function check(job)
  if not seen[job] then
    seen[job], last = true, '@' .. job .. '#'
    if redis.call('EXISTS', KEYS[5] .. ':' .. job) == 0 and redis.call('EXISTS', 'rq:job:' .. job) == 0 then
      return redis.error_reply('HARVEST_NO_JOB ' .. job)
    end
  end
end
for s = 1, nseg do
  local job, n, ni, nr = ARGV[q + 5], tonumber(ARGV[q + 6]), tonumber(ARGV[q + 7]), tonumber(ARGV[q + 8])
  if job ~= '' then  -- rows are indexes into the job: `spool_job`'s form alone
    if not (ARGV[q] == 's' and ARGV[q + 1] == 'q_' and ni <= 1 and nr == n) then
      return redis.error_reply('HARVEST_BAD_SEGMENT a job is named only in the spool of a worker job')
    end
    if n > 0 then
      local err = check(job)
      if err then return err end
    end
  elseif ARGV[q] == 's' then
    for i = 1, nr do
      local r = ARGV[q + 8 + n + ni + i]
      local j = not (last and string.find(r, last, 1, true) == 1) and ref_job(r)
      local err = j and check(j)
      if err then return err end
    end
  end
  q = q + 9 + n + ni + nr
end
local out = {}
for s = 1, nseg do
  local to, allowed, keep, cnt, sum, job = ARGV[p], ARGV[p + 1], ARGV[p + 2] == '1', ARGV[p + 3], ARGV[p + 4], ARGV[p + 5]
  local n, ni, nr = tonumber(ARGV[p + 6]), tonumber(ARGV[p + 7]), tonumber(ARGV[p + 8])
  local changed
  if job ~= '' then  -- a worker's job (`Ledger.settle_job`)
    changed = spool_job(n, p + 8, ni == 1 and ARGV[p + 9 + n] or '', job, p + 8 + n + ni)
  elseif to == 'd' and nr == 0 and not keep and string.find(allowed, 's', 1, true) then  -- a shard's commit
    changed = commit_shard(n, p + 8)  -- nil: a sample in another form, for `move`
  end
  changed = changed or move(to, allowed, n, p + 8, keep, ni, nr)
  if cnt ~= '' and #changed > 0 then bump(stats, cnt, #changed) end
  if sum ~= '' and #changed > 0 then
    -- one info, `<total>/<n1>,<n2>,...`: the total when every sample listed moved (a shard's
    -- commit), else the numbers of those that did, in the order of the ids
    local all, each = string.match(ARGV[p + 9 + n], '^(%d+)/(.*)$')
    local total = 0
    if #changed == n then
      total = tonumber(all) or 0
    elseif each then
      local moved, i = {}, 0
      for _, id in ipairs(changed) do moved[id] = true end
      for t in string.gmatch(each, '[^,]+') do
        i = i + 1
        local id = ARGV[p + 8 + i]
        if moved[id] then total = total + (tonumber(t) or 0); moved[id] = nil end
      end
    end
    if total > 0 then bump(stats, sum, total) end
  end
  out[s] = #changed == n and n or changed  -- a count where every id listed moved: 32 ids back cost a call ~10 µs
  p = p + 9 + n + ni + nr
end
local npairs = tonumber(ARGV[p]); p = p + 1
for i = 1, npairs do
  local v = tonumber(ARGV[p + 1])
  if v ~= 0 then bump(stats, ARGV[p], v) end
  p = p + 2
end
finish()
local rate = next(stats) ~= nil and rate_key(ARGV[2], tonumber(ARGV[3]))
for f, v in pairs(stats) do
  redis.call('HINCRBY', KEYS[11], f, v)
  redis.call('HINCRBY', rate, f, v)
end
if rate then redis.call('EXPIRE', rate, tonumber(ARGV[1])) end
if ARGV[p] then  -- a record ended with these moves (a collector's packing record) and the set indexing it
  local rec, idx = KEYS[tonumber(ARGV[p])], KEYS[tonumber(ARGV[p + 1])]
  redis.call('SREM', idx, rec)
  redis.call('DEL', rec)
end
return out
"""

# The run's stats alone. KEYS: stats. ARGV: bucket ttl, rate key prefix, bucket seconds,
# (field, increment) pairs.
ADD_STATS = RATE_KEY + """
local rate = rate_key(ARGV[2], tonumber(ARGV[3]))
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', rate, ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', rate, tonumber(ARGV[1]))
return 1
"""
