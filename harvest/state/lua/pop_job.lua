-- RQ's dequeue of one queue in one call: the first job id moved to the queue's intermediate list
-- (LMOVE, as RQ does), and that job's hash read.
-- KEYS[1] = the queue
-- KEYS[2] = its intermediate list
-- ARGV[1] = RQ's job key prefix
-- Returns {job id, the job hash's fields and values}, or false for an empty queue.
local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if not id then return false end
return {id, redis.call('HGETALL', ARGV[1] .. id)}
