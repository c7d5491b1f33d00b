-- One move of samples between states (lib/move.lua `move`), and what it changed written.
-- KEYS[1] = state
-- KEYS[2] = counts
-- KEYS[3] = failed
-- KEYS[4] = spool_owner
-- KEYS[5] = spooled_payload
-- KEYS[6] = spool_counts
-- KEYS[7] = revoked_spools
-- KEYS[8] = failed_reasons
-- KEYS[9] = failed_examples
-- KEYS[10] = failed_payload
-- ARGV[1] = the job copies' key prefix (Keys.job_copy_prefix)
-- ARGV[2] = RQ's job key prefix
-- ARGV[3] = to: the state letter the samples move to
-- ARGV[4] = allowed: the state letters they may move from ('_' absent)
-- ARGV[5] = keep: '1' where a move to f keeps the rows as failed payloads
-- ARGV[6] = n: the number of ids
-- ARGV[7] = ni: the number of infos (0, 1 or n: lib/move.lua `move`)
-- ARGV[8] = nr: the number of rows (0, 1 or n)
-- ARGV[9+] = the n ids, the ni infos, the nr rows
-- Returns the moved ids in order.
--! include lib/move.lua
local m = new_moves(move_keys(KEYS, 1), ARGV[1], ARGV[2])
local changed = move(m, ARGV, ARGV[3], ARGV[4], tonumber(ARGV[6]), 8, ARGV[5] == '1', tonumber(ARGV[7]),
                     tonumber(ARGV[8]))
finish(m)
return changed
