-- Reaping held for some seconds from the server's TIME, never shortening a hold.
-- KEYS[1] = reap_after
-- ARGV[1] = the seconds
-- Returns the Redis time until which reaping is held.
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
local old = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if old > until_ then until_ = old end
local stamp = string.format('%.6f', until_)
redis.call('SET', KEYS[1], stamp, 'EX', math.ceil(until_ - tonumber(t[1])) + 1)
return stamp
