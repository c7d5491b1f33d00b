--! include lib/move.lua
-- The two moves every sample makes, each a call's whole work in a fleet: its job's spool (q -> s)
-- and its shard's commit (s -> d). `move` does both, but its generality (any source state, an
-- owner and a ref parsed a sample, the side hashes of older values, failures) costs the server
-- more a sample in each (bench/job_cost.py). These do the same writes, counted in the same tables
-- of `m` for `finish`, for the forms a fleet's samples have (tests/unit/test_settle_hot.py holds
-- them to `move`'s writes).

-- spool_job(m, argv, n, base, owner, job, rb): the samples argv[base+1..base+n], queued or absent,
-- to `s:<owner>@<job>#<index>`, their indexes argv[rb+1..rb+n] (the ref `move` would write for a
-- row `@<job>#<index>`); none for a revoked owner. An id listed twice moves once. Returns the
-- moved ids in order.
local function spool_job(m, argv, n, base, owner, job, rb)
  if owner ~= '' and revoked(m, owner) then return {} end
  local state = m.k.state
  local pre, changed, seen, nq = 's:' .. owner .. '@' .. job .. '#', {}, {}, 0
  for lo = 1, n, BATCH do
    local hi = math.min(n, lo + BATCH - 1)
    local cur, st = redis.call('HMGET', state, unpack(argv, base + lo, base + hi)), {}
    for i = lo, hi do
      local v, id = cur[i - lo + 1], argv[base + i]
      if (not v or v == 'q') and not seen[id] then
        seen[id] = true
        if v then nq = nq + 1 end
        st[#st + 1] = id; st[#st + 1] = pre .. argv[rb + i]
        changed[#changed + 1] = id
      end
    end
    hset(state, st)
  end
  local c = #changed
  if c > 0 then
    bump(m.dcount, 'q', -nq); bump(m.dcount, 's', c)
    if owner ~= '' then bump(m.dspool, owner, c) end
    bump(m.drefs, job, c)
  end
  return changed
end

-- commit_shard(m, argv, n, base): the samples argv[base+1..base+n] to d, where each is done
-- already or spooled with a ref (`s:<owner>@<job>#<i>`); nil, having written nothing, where any
-- is not (queued, absent, failed, spooled with its row kept in full or by an older harvest):
-- `move` does those. Returns the moved ids in order.
local function commit_shard(m, argv, n, base)
  local state = m.k.state
  local st, changed, seen, owners, jobs = {}, {}, {}, {}, {}
  local vpre, vo, vjob  -- the prefix `s:<owner>@<job>#` of the last value parsed, and its parts
  for lo = 1, n, BATCH do
    local hi = math.min(n, lo + BATCH - 1)
    local cur = redis.call('HMGET', state, unpack(argv, base + lo, base + hi))
    for i = lo, hi do
      local v, id = cur[i - lo + 1], argv[base + i]
      if v ~= 'd' and not seen[id] then
        if not (vpre and v and string.find(v, vpre, 1, true) == 1) then
          local o, job = spooled_in(v or '')
          if not job then return nil end
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
  for lo = 1, #st, 2 * BATCH do redis.call('HSET', state, unpack(st, lo, math.min(#st, lo + 2 * BATCH - 1))) end
  if #changed > 0 then bump(m.dcount, 's', -#changed); bump(m.dcount, 'd', #changed) end
  for o, c in pairs(owners) do bump(m.dspool, o, -c) end
  for job, c in pairs(jobs) do bump(m.drefs, job, -c) end
  return changed
end
