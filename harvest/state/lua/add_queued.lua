-- The producer's enqueue: absent -> q, and nothing else (`Ledger.add_queued`). lib/move.lua
-- `move` does it too, but its generality costs the server about a microsecond a sample more than
-- this loop (bench/job_cost.py, "producer: to queued"), and the text of a script is sent with each
-- call in the producer's transaction (an EVAL), 7 KB where this is a few hundred bytes.
-- KEYS[1] = state
-- KEYS[2] = counts
-- ARGV[1+] = the ids
-- Returns the ids that did not move (known already): an id listed twice moves once.
local n, left, moved = 0, {}, {}
for lo = 1, #ARGV, 400 do
  local hi = math.min(#ARGV, lo + 399)
  local cur, st = redis.call('HMGET', KEYS[1], unpack(ARGV, lo, hi)), {}
  for j = 1, hi - lo + 1 do
    local id = ARGV[lo + j - 1]
    if moved[id] then  -- listed before, and moved then
    elseif cur[j] then left[#left + 1] = id
    else moved[id] = true; st[#st + 1] = id; st[#st + 1] = 'q'; n = n + 1 end
  end
  if #st > 0 then redis.call('HSET', KEYS[1], unpack(st)) end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'q', n) end
return left
