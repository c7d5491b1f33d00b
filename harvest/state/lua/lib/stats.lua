-- The run's stats: its totals and the current rate bucket, the one writer of both. The bucket is
-- by the server's TIME, so every node's stats land in the buckets `Ledger.rates` reads, whatever
-- the node's clock says (Redis 7 replicates a script's effects, so a script may read TIME before
-- it writes).

-- add_stats(stats_key, rate_prefix, bucket_s, ttl_s, stats): add `stats` (field -> increment) to
-- the totals at `stats_key` and to the bucket `<rate_prefix><TIME / bucket_s>`, which expires
-- `ttl_s` after its last write. Nothing where `stats` is empty.
local function add_stats(stats_key, rate_prefix, bucket_s, ttl_s, stats)
  if next(stats) == nil then return end
  local t = redis.call('TIME')
  local rate = rate_prefix .. math.floor(tonumber(t[1]) / bucket_s)
  for f, v in pairs(stats) do
    redis.call('HINCRBY', stats_key, f, v)
    redis.call('HINCRBY', rate, f, v)
  end
  redis.call('EXPIRE', rate, ttl_s)
end
