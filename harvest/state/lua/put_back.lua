-- A job dequeued into RQ's intermediate list moved back to its queue, unless it is queued already
-- or its hash is gone.
-- KEYS[1] = the intermediate list
-- KEYS[2] = the queue
-- KEYS[3] = the job hash
-- ARGV[1] = the job id
-- Returns 1 where it was put back, else 0.
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 or redis.call('LPOS', KEYS[2], ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
