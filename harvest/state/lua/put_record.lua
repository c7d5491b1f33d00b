-- A collector's packing record written and indexed, with the commit fence's ownership test in
-- the same call (lib/owns.lua), and the ledger's id restored where a Redis lost it
-- (`Ledger.identity`).
-- KEYS[1] = state
-- KEYS[2] = spool_owner
-- KEYS[3] = revoked_spools
-- KEYS[4] = the record
-- KEYS[5] = the index of records (Keys.packing_index)
-- KEYS[6] = the ledger's id (Keys.ledger_id)
-- ARGV[1] = the record JSON
-- ARGV[2] = the spool
-- ARGV[3] = the ledger's id as the caller knows it
-- ARGV[4+] = the ids to test (none: the spool's revocation alone)
-- Returns {1 where the spool owns them else 0, the ledger's id in force}.
--! include lib/owns.lua
redis.call('SET', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[5], KEYS[4])
local id = redis.call('GET', KEYS[6])
if not id then id = ARGV[3]; redis.call('SET', KEYS[6], id) end
return {owns(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV, 3, #ARGV - 3) and 1 or 0, id}
