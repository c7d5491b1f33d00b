--! include lib/job_refs.lua
-- The general move of sample states, with everything kept beside the states (counters per
-- state, per spool and per failure reason, the failures, the rows kept, the job copies' refs).
--
-- Why the moves are batched. Redis runs scripts on its one thread, and each `redis.call` costs
-- about a microsecond of it: a call reads the states of up to BATCH samples with one HMGET,
-- writes them with one HSET, and the counters are summed in Lua and written once a call
-- (`finish`). Who owns a spooled sample, and what fences a late return: the spool its value
-- names, until the sample moves on; a move to s for a revoked spool is refused. The state, its
-- owner and its ref are one field written by one script with the counters and the job copy's ref
-- count (one AOF entry), so they cannot part.

local BATCH = 400  -- ids a command reads or writes at once (Lua's unpack is bounded near 8000 values)

-- move_keys(keys, at): the 10 keys of a move, keys[at..at+9], by name (harvest.state.scripts
-- `move_keys` sends them in this order).
local function move_keys(keys, at)
  return {state = keys[at], counts = keys[at + 1], failed = keys[at + 2], spool_owner = keys[at + 3],
          spooled_payload = keys[at + 4], spool_counts = keys[at + 5], revoked = keys[at + 6],
          failed_reasons = keys[at + 7], failed_examples = keys[at + 8], failed_payload = keys[at + 9]}
end

-- new_moves(k, copy_prefix, job_prefix): the moves of one call, over the keys `k` (`move_keys`):
-- what they changed, summed for `finish`, and each sample's value as the call left it.
local function new_moves(k, copy_prefix, job_prefix)
  return {k = k, copy_prefix = copy_prefix, job_prefix = job_prefix, dcount = {}, dspool = {}, dreason = {},
          leaving = {}, examples = {}, drefs = {}, revoked = {}, now = {}}
end

local function bump(t, key, v) t[key] = (t[key] or 0) + v end
local function hset(key, pairs) if #pairs > 0 then redis.call('HSET', key, unpack(pairs)) end end
local function hdel(key, ids) if #ids > 0 then redis.call('HDEL', key, unpack(ids)) end end

-- revoked(m, spool): whether `spool` is revoked, asked once a call.
local function revoked(m, spool)
  local r = m.revoked[spool]
  if r == nil then
    r = redis.call('SISMEMBER', m.k.revoked, spool) == 1
    m.revoked[spool] = r
  end
  return r
end

-- failure(info): the reason and message of a failure's JSON.
local function failure(info)
  local ok, t = pcall(cjson.decode, info)
  if ok and type(t) == 'table' then
    return tostring(t.reason or '?'), tostring(t.message or '')
  end
  return '?', ''
end

-- unref(m, ids): the rows kept for `ids` in the spooled_payload hash are about to go, their refs with them.
local function unref(m, ids)
  if #ids == 0 then return end
  for _, r in ipairs(redis.call('HMGET', m.k.spooled_payload, unpack(ids))) do
    local job = ref_job(r)
    if job then bump(m.drefs, job, -1) end
  end
end

-- shared(argv, at, k): the value of a run of `k` values at argv[at+1..] that all samples share, or nil.
local function shared(argv, at, k)
  if k == 0 then return '' elseif k == 1 then return argv[at + 1] end
  return nil
end

-- move(m, argv, to, allowed, n, base, keep, ni, nr): the samples argv[base+1..base+n] move to `to`
-- from any state letter in `allowed` ('_' = absent), except to s for a revoked spool. Their infos
-- follow the ids, then their rows: `ni` infos and `nr` rows, each 0 (every one ''), 1 (one for all)
-- or n (one a sample), so a value the samples share crosses into Lua once. info: the failure JSON
-- when moving to f, the owning spool id when moving to s, otherwise unread but for being set. row:
-- the payload row kept while spooled (to s), or kept as the failed payload (to f, when `keep`).
-- Returns the moved ids in order; `finish(m)` writes the counters. An id listed twice moves once.
-- The loop over the samples is the server's work a sample: its counts are kept in locals and
-- summed once a call, not bumped through a function a sample.
local function move(m, argv, to, allowed, n, base, keep, ni, nr)
  local k, now, dspool, drefs, dreason, examples = m.k, m.now, m.dspool, m.drefs, m.dreason, m.examples
  local changed = {}
  local from_ok = {}
  for c = 1, #allowed do from_ok[string.sub(allowed, c, c)] = true end
  from_ok[to] = nil
  local ib, rb = base + n, base + n + ni
  local ishared, rshared = shared(argv, ib, ni), shared(argv, rb, nr)
  local left, arrived = {}, 0  -- samples moved out of each state, and into `to`
  -- a job's samples come together: the prefix of the last ref (`@<job>#`) and spooled value
  -- (`s:<owner>@<job>#`) parsed, and what it held, so the next sample's is a plain comparison
  local rpre, rpjob, vpre, vpo, vpjob
  for lo = 1, n, BATCH do
    local hi = math.min(n, lo + BATCH - 1)
    local ids = {}
    for i = lo, hi do ids[#ids + 1] = argv[base + i] end
    local cur = redis.call('HMGET', k.state, unpack(ids))
    local st, fl, row, kept, from_s, bare_s, from_f, stale = {}, {}, {}, {}, {}, {}, {}, {}
    for j = 1, #ids do
      local i = lo + j - 1
      local id = ids[j]
      local v = now[id]
      if v == nil then v = cur[j] end
      local c = v and string.sub(v, 1, 1) or '_'
      local info = from_ok[c] and (ishared or argv[ib + i])
      if info and not (to == 's' and info ~= '' and revoked(m, info)) then
        local r = rshared or argv[rb + i]
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
          -- without a ref in its value, its row (if any) is in the spooled_payload hash
          if held then drefs[held] = (drefs[held] or 0) - 1 else from_s[#from_s + 1] = id end
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
      local owners = redis.call('HMGET', k.spool_owner, unpack(bare_s))
      for j = 1, #bare_s do
        if owners[j] and owners[j] ~= '' then bump(dspool, owners[j], -1) end
      end
      hdel(k.spool_owner, bare_s)
    end
    if #from_s > 0 then
      unref(m, from_s)
      hdel(k.spooled_payload, from_s)
    end
    if #from_f > 0 and to ~= 'f' then
      local old = redis.call('HMGET', k.failed, unpack(from_f))
      for j = 1, #from_f do
        if old[j] then bump(dreason, (failure(old[j])), -1) end
        m.leaving[from_f[j]] = true
      end
      hdel(k.failed, from_f)
    end
    hset(k.state, st)
    hset(k.failed, fl)
    unref(m, stale)  -- a row left behind for a sample that was not spooled (repaired by harvest.ops.ledgercheck)
    hset(k.spooled_payload, row)
    hset(k.failed_payload, kept)
  end
  for c, d in pairs(left) do bump(m.dcount, c, -d) end
  if arrived > 0 then bump(m.dcount, to, arrived) end
  return changed
end

-- finish(m): write what the moves of `m` changed: the job copies' refs, the failures' examples
-- and the counters per state, per spool and per failure reason.
local function finish(m)
  local k = m.k
  for job, d in pairs(m.drefs) do if d ~= 0 then add_refs(m.copy_prefix, m.job_prefix, job, d) end end
  for reason, ex in pairs(m.examples) do redis.call('HSET', k.failed_examples, reason, ex) end
  for s, d in pairs(m.dcount) do if d ~= 0 then redis.call('HINCRBY', k.counts, s, d) end end
  for spool, d in pairs(m.dspool) do
    if d ~= 0 and redis.call('HINCRBY', k.spool_counts, spool, d) <= 0 then
      redis.call('HDEL', k.spool_counts, spool)
    end
  end
  for reason, d in pairs(m.dreason) do
    if d ~= 0 then
      local left = redis.call('HINCRBY', k.failed_reasons, reason, d)
      local ex = d < 0 and redis.call('HGET', k.failed_examples, reason)
      if left <= 0 then
        redis.call('HDEL', k.failed_reasons, reason)
        redis.call('HDEL', k.failed_examples, reason)
      elseif ex and m.leaving[string.match(ex, '^([^:]*)')] and not m.examples[reason] then
        redis.call('HDEL', k.failed_examples, reason)  -- its example is no longer failed
      end
    end
  end
end
