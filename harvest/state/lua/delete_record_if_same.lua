-- A packing record removed only while it is still the one the caller acted on.
-- KEYS[1] = the record
-- KEYS[2] = the index of records (Keys.packing_index)
-- ARGV[1] = the record as the caller read it
-- Returns 1 where it was removed, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SREM', KEYS[2], KEYS[1])
  return redis.call('DEL', KEYS[1])
end
return 0
