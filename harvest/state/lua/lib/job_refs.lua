--! include lib/state_value.lua
-- The copies of RQ's job hashes that spooled samples' refs point into (harvest.state.jobcopy):
-- every script that writes or drops a ref keeps the copy's counter of refs, and the last ref
-- deletes the copy. copy_prefix: `Keys.job_copy_prefix`; job_prefix: RQ's job key prefix
-- (`harvest.state.keys.rq_job_prefix`).

-- add_refs(copy_prefix, job_prefix, job, d): `d` refs more to the copy of `job` (made from RQ's
-- hash of the job where it is missing and refs are added); the copy goes with its last ref.
local function add_refs(copy_prefix, job_prefix, job, d)
  local copy = copy_prefix .. job
  if d > 0 and redis.call('EXISTS', copy) == 0 then
    redis.call('COPY', job_prefix .. job, copy)
    redis.call('PERSIST', copy)
  end
  if redis.call('HINCRBY', copy, 'harvest_refs', d) <= 0 then redis.call('DEL', copy) end
end

-- drop_ref(copy_prefix, row): a row leaving gives back its ref, if it is one.
local function drop_ref(copy_prefix, row)
  local job = ref_job(row)
  if job then add_refs(copy_prefix, '', job, -1) end
end
