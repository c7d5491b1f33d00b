-- Several moves and the run's stats in one call: a worker's job at its end (its spooled and its
-- failed samples, the failures counted), a collector's shard at its commit (done; reconcile's
-- with its count). Their common cases go through lib/hot_moves.lua, everything else through
-- lib/move.lua `move`. Who owns a sample and what fences a late return are `move`'s: a revoked
-- spool's move to s is refused, and the writes of one call are one AOF entry.
-- KEYS[1] = state
-- KEYS[2] = counts
-- KEYS[3] = failed
-- KEYS[4] = spool_owner
-- KEYS[5] = spooled_payload
-- KEYS[6] = spool_counts
-- KEYS[7] = revoked_spools
-- KEYS[8] = failed_reasons
-- KEYS[9] = failed_examples
-- KEYS[10] = failed_payload
-- KEYS[11] = the run's stats
-- KEYS[12+] = optionally a record these moves end (a collector's packing record) and the set
--             indexing it: both removed
-- ARGV[1] = the job copies' key prefix (Keys.job_copy_prefix)
-- ARGV[2] = RQ's job key prefix
-- ARGV[3] = the rate bucket's ttl in seconds
-- ARGV[4] = the rate key prefix (Keys.rate_prefix)
-- ARGV[5] = the rate bucket's seconds
-- ARGV[6] = the number of segments
-- ARGV[7+] = the segments, then the number of stat pairs and the (field, increment) pairs. A
--            segment: to, allowed, keep, count field ('' none), sum field ('' none; else the
--            segment's one info is `<total>/<n1>,<n2>,...`, the numbers it sums over the moved
--            samples), job ('' none; else a worker job's spool, q or absent -> s, whose rows are
--            the samples' indexes in that job: `spool_job`), n, ni, nr, the n ids, the ni infos,
--            the nr rows (lib/move.lua `move`)
-- Returns per segment the moved ids, or their number where every id listed moved (then none was
-- listed twice).
--! include lib/hot_moves.lua
--! include lib/stats.lua

-- segment(p): the segment whose first value is ARGV[p], its fields by name; `ids` is the index
-- before its first id, `infos` before its first info, `rows` before its first row, `next` the
-- index of what follows it.
local function segment(p)
  local n, ni, nr = tonumber(ARGV[p + 6]), tonumber(ARGV[p + 7]), tonumber(ARGV[p + 8])
  return {to = ARGV[p], allowed = ARGV[p + 1], keep = ARGV[p + 2] == '1', count = ARGV[p + 3],
          sum = ARGV[p + 4], job = ARGV[p + 5], n = n, ni = ni, nr = nr,
          ids = p + 8, infos = p + 8 + n, rows = p + 8 + n + ni, next = p + 9 + n + ni + nr}
end

local m = new_moves(move_keys(KEYS, 1), ARGV[1], ARGV[2])
local stats = {}
local segs, p = {}, 7
for s = 1, tonumber(ARGV[6]) do
  segs[s] = segment(p)
  p = segs[s].next
end

-- Every job a row to spool refers to is still there to copy (or copied), before anything moves.
local seen, last = {}, nil  -- last: `@<job>#` of the job checked last (a job's rows come together)
local function check(job)
  if not seen[job] then
    seen[job], last = true, '@' .. job .. '#'
    if redis.call('EXISTS', ARGV[1] .. job) == 0 and redis.call('EXISTS', ARGV[2] .. job) == 0 then
      return redis.error_reply('HARVEST_NO_JOB ' .. job)
    end
  end
end
for _, g in ipairs(segs) do
  if g.job ~= '' then  -- rows are indexes into the job: `spool_job`'s form alone
    if not (g.to == 's' and g.allowed == 'q_' and g.ni <= 1 and g.nr == g.n) then
      return redis.error_reply('HARVEST_BAD_SEGMENT a job is named only in the spool of a worker job')
    end
    if g.n > 0 then
      local err = check(g.job)
      if err then return err end
    end
  elseif g.to == 's' then
    for i = 1, g.nr do
      local r = ARGV[g.rows + i]
      local j = not (last and string.find(r, last, 1, true) == 1) and ref_job(r)
      local err = j and check(j)
      if err then return err end
    end
  end
end

local out = {}
for s, g in ipairs(segs) do
  local changed
  if g.job ~= '' then  -- a worker's job (`Ledger.settle_job`)
    changed = spool_job(m, ARGV, g.n, g.ids, g.ni == 1 and ARGV[g.infos + 1] or '', g.job, g.rows)
  elseif g.to == 'd' and g.nr == 0 and not g.keep and string.find(g.allowed, 's', 1, true) then  -- a shard's commit
    changed = commit_shard(m, ARGV, g.n, g.ids)  -- nil: a sample in another form, for `move`
  end
  changed = changed or move(m, ARGV, g.to, g.allowed, g.n, g.ids, g.keep, g.ni, g.nr)
  if g.count ~= '' and #changed > 0 then bump(stats, g.count, #changed) end
  if g.sum ~= '' and #changed > 0 then
    -- one info, `<total>/<n1>,<n2>,...`: the total when every sample listed moved (a shard's
    -- commit), else the numbers of those that did, in the order of the ids
    local all, each = string.match(ARGV[g.infos + 1], '^(%d+)/(.*)$')
    local total = 0
    if #changed == g.n then
      total = tonumber(all) or 0
    elseif each then
      local moved, i = {}, 0
      for _, id in ipairs(changed) do moved[id] = true end
      for t in string.gmatch(each, '[^,]+') do
        i = i + 1
        local id = ARGV[g.ids + i]
        if moved[id] then total = total + (tonumber(t) or 0); moved[id] = nil end
      end
    end
    if total > 0 then bump(stats, g.sum, total) end
  end
  out[s] = #changed == g.n and g.n or changed  -- a count where every id listed moved: no ids sent back
end
for i = 1, tonumber(ARGV[p]) do
  local at = p + 2 * i - 1
  local v = tonumber(ARGV[at + 1])
  if v ~= 0 then bump(stats, ARGV[at], v) end
end
finish(m)
add_stats(KEYS[11], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[3]), stats)
if KEYS[12] then
  redis.call('SREM', KEYS[13], KEYS[12])
  redis.call('DEL', KEYS[12])
end
return out
