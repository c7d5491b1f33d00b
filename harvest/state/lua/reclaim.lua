-- The janitor's reclaim of a revoked spool: s -> q for the samples the spool still owns (the
-- owner in the state value, or for a bare `s` an older harvest wrote, in the spool_owner hash).
-- KEYS[1] = state
-- KEYS[2] = counts
-- KEYS[3] = spool_owner
-- KEYS[4] = spooled_payload
-- KEYS[5] = spool_counts
-- ARGV[1] = the job copies' key prefix (Keys.job_copy_prefix)
-- ARGV[2] = the spool
-- ARGV[3+] = the ids
-- Returns the ids moved.
--! include lib/job_refs.lua
local copies, spool = ARGV[1], ARGV[2]
local moved = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local v = redis.call('HGET', KEYS[1], id)
  local owner = letter(v) == 's' and (owner_in(v) or redis.call('HGET', KEYS[3], id))
  if owner == spool then
    redis.call('HSET', KEYS[1], id, 'q')
    redis.call('HINCRBY', KEYS[2], 's', -1)
    redis.call('HINCRBY', KEYS[2], 'q', 1)
    redis.call('HDEL', KEYS[3], id)
    local held = ref_in(v)
    if held then drop_ref(copies, held) end
    drop_ref(copies, redis.call('HGET', KEYS[4], id))
    redis.call('HDEL', KEYS[4], id)
    if redis.call('HINCRBY', KEYS[5], spool, -1) <= 0 then redis.call('HDEL', KEYS[5], spool) end
    moved[#moved + 1] = id
  end
end
return moved
