-- Forget samples in one state: done ones no index in storage names (an index file lost), so the
-- producer enqueues them again; queued ones a rerun's dataset no longer holds (--prune), so no
-- worker extracts them (a job's worker takes only its queued samples).
-- KEYS[1] = state
-- KEYS[2] = counts
-- ARGV[1] = the state letter the samples must be in
-- ARGV[2+] = the ids
-- Returns the ids forgotten.
local want = ARGV[1]
local gone = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[1], id) == want then
    redis.call('HDEL', KEYS[1], id)
    redis.call('HINCRBY', KEYS[2], want, -1)
    gone[#gone + 1] = id
  end
end
return gone
