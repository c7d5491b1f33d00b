-- A spool's lease renewed, stamped with Redis's TIME; refused for a revoked spool.
-- KEYS[1] = spool_leases
-- KEYS[2] = spool_nodes
-- KEYS[3] = revoked_spools
-- ARGV[1] = the spool
-- ARGV[2] = its node
-- Returns 1 where renewed, 0 where the spool is revoked.
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
