-- The state value of a sample, read: its letter (q, s, d, f), and for a spooled sample the spool
-- that owns it and, where its row is kept as a ref to a copy of its job (harvest.state.jobcopy),
-- that ref: `s:<spool>` (`s:` for no owner), `s:<spool>@<job id>#<index>`. A bare `s` (an older
-- harvest's) keeps its owner in the spool_owner hash. Spool ids never hold an `@` (harvest.ids).
-- The one parser of the value in Lua (harvest.state.ledger `spooled_parts` is Python's).

-- letter(v): the state letter of a state value; '_' for absent.
local function letter(v) return v and string.sub(v, 1, 1) or '_' end

-- owner_in(v): the owner a spooled state value names ('' none); nil for a bare `s`.
local function owner_in(v) if #v > 1 then return string.match(v, '^s:([^@]*)') end return nil end

-- ref_in(v): the ref a spooled state value holds (`@<job id>#<index>`), nil if none.
local function ref_in(v) return v and string.match(v, '^s:[^@]*(@.+)$') end

-- spooled_in(v): owner_in(v) and the job of its ref (nil if none), with one pattern match where
-- the value holds a ref, not three (each match and its captures are the server's work a sample).
local function spooled_in(v)
  local o, job = string.match(v, '^s:([^@]*)@([^#]+)#')
  if o then return o, job end
  return owner_in(v), nil
end

-- ref_job(row): the job a ref (`@<job id>#<index>`) points into; nil for a row kept in full.
local function ref_job(row) return row and string.match(row, '^@([^#]+)#') end
