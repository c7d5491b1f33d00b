-- A heartbeat written: its fields, the fields stamped with Redis's TIME and its TTL land together.
-- KEYS[1] = the heartbeat hash
-- KEYS[2+] = optionally a set to add ARGV[3] to (the run's workers or collectors)
-- ARGV[1] = the ttl in seconds
-- ARGV[2] = the fields to stamp with Redis's TIME, space-separated ('' none)
-- ARGV[3] = the member of the set
-- ARGV[4+] = field/value pairs
-- Returns the stamp.
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
for f in string.gmatch(ARGV[2], '%S+') do redis.call('HSET', KEYS[1], f, now) end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
if KEYS[2] then redis.call('SADD', KEYS[2], ARGV[3]) end
return now
