-- A packing record's entry in the index dropped where the record is gone.
-- KEYS[1] = the record
-- KEYS[2] = the index of records (Keys.packing_index)
-- Returns 1 where the entry was dropped, else 0.
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], KEYS[1]) end
return 0
