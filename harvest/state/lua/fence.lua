-- The commit fence: a shard's packing record (with its index document) written only when the
-- spool is not revoked, every sample is in state s, owned by it (or by no spool: spooled without
-- an owner, which no reclaim can take), and the record is still the one the collector wrote: a
-- Redis that forgot the record (a rollback, a failover) forgot who is packing the shard, and a
-- claim in storage naming it may then be taken over (harvest.formats.claims), so the shard must
-- not be committed.
-- KEYS[1] = state
-- KEYS[2] = spool_owner
-- KEYS[3] = revoked_spools
-- KEYS[4] = the packing record
-- ARGV[1] = the spool
-- ARGV[2] = the record JSON, with the shard's index document
-- ARGV[3] = the record as the collector wrote it before packing
-- ARGV[4+] = the ids
-- Returns 1 where the record was written (or already was), else 0.
--! include lib/owns.lua
local spool, record, before = ARGV[1], ARGV[2], ARGV[3]
local held = redis.call('GET', KEYS[4])  -- read once: nothing below writes it before the SET
-- already fenced with this very record: a retry whose first reply was lost (harvest.state.connection)
if record ~= '' and held == record then return 1 end
if not owns(KEYS[1], KEYS[2], KEYS[3], spool, ARGV, 3, #ARGV - 3) then return 0 end
if held ~= before then return 0 end
redis.call('SET', KEYS[4], record)
return 1
