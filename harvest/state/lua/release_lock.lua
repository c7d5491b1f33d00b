-- A lock taken with SET NX PX and a random token, let go only by its holder: released now, or
-- held for some milliseconds more (a renewal, or a release after a pause).
-- KEYS[1] = the lock
-- ARGV[1] = the holder's token
-- ARGV[2] = 0: release now; else hold for this many milliseconds from now
-- Returns 0 where the lock is not the holder's, else the DEL's or PEXPIRE's reply.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('DEL', KEYS[1])
