-- The run's stats and latency histograms, added to (lib/stats.lua): the ledger's `add_stats`
-- and a process's tally flushed at its heartbeat (harvest.state.tally).
-- KEYS[1] = the run's stats
-- KEYS[2+] = one histogram each
-- ARGV[1] = the rate bucket's ttl in seconds
-- ARGV[2] = the rate key prefix (Keys.rate_prefix)
-- ARGV[3] = the rate bucket's seconds
-- ARGV[4] = the number of stat pairs
-- ARGV[5+] = (field, increment) pairs; then per histogram, in KEYS' order: the number of its
--            buckets, (bucket, count) pairs, its count and its sum
--! include lib/stats.lua
local n, p = tonumber(ARGV[4]), 5
local stats = {}
for i = 1, n do
  stats[ARGV[p]] = (stats[ARGV[p]] or 0) + tonumber(ARGV[p + 1])
  p = p + 2
end
add_stats(KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[1]), stats)
for k = 2, #KEYS do
  local nb = tonumber(ARGV[p]); p = p + 1
  for i = 1, nb do
    redis.call('HINCRBY', KEYS[k], ARGV[p], ARGV[p + 1])
    p = p + 2
  end
  redis.call('HINCRBY', KEYS[k], 'count', ARGV[p])
  redis.call('HINCRBYFLOAT', KEYS[k], 'sum', ARGV[p + 1])
  p = p + 2
end
return 1
