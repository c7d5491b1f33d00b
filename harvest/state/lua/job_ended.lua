-- A worker's job ended: the heartbeat's fields, one more job done and the TTL land together.
-- KEYS[1] = the heartbeat hash
-- ARGV[1] = the ttl in seconds
-- ARGV[2+] = field/value pairs
-- Returns 1.
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('HINCRBY', KEYS[1], 'jobs_done', 1)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
