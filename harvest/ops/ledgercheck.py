"""The ledger's invariants, checked (`harvest status --check`) and repaired (`harvest reconcile`).

The ledger (harvest.state.ledger) keeps one state letter per sample in one hash, so a sample
cannot hold two states; what can disagree is everything kept beside it: the per-state counters
(status, `runs` and the end of `harvest run` read only those), the failures hash (what `requeue`
selects from), the spool owners and their per-spool counts. Every move goes through one Lua
script that keeps them together, so they part only when the writes themselves were mixed up:
two redis-servers on one append-only file (two `harvest run`s on one work dir, issue 26: "done
50 failed 50" for a 50-sample run, `requeue --all` finding nothing), or a hand edit. The check
reads the state hash and the rest in one Lua call (one consistent snapshot) and names each
disagreement; the repair rebuilds the counters and side tables from the state hash, the one
truth Redis has (storage's index files then correct the states themselves: `reconcile`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from harvest.state.failures import WORKER_ERROR
from harvest.state.keys import Keys
from harvest.state.ledger import STATE_NAMES
from harvest.state.ledger_lua import DROP_REF, STATE_VALUE

# KEYS: state, counts, failed, spool_owner, spooled_payload, spool_counts. ARGV: repair (0/1), the
# failure JSON given to a failed sample without one, then the job ids of the job copies found
# (harvest.state.jobcopy). A spooled sample's owner and the ref to its row are in its state value
# (`s:<spool>@<job>#<i>`), or for a bare `s` (an older harvest's) in the spool_owner and
# spooled_payload hashes; an entry there for any other sample is a stray, and so is a row in the
# hash for a sample whose value holds its ref. Each job copy's counter of refs must be the refs
# held. Returns a JSON document of what disagrees (each list holds up to 5 examples) and, with
# repair, fixes it from the state hash.
_CHECK = DROP_REF + STATE_VALUE + """
local repair = ARGV[1] == '1'
local recount, owned = {}, {}
local out = {counts = {}, failed_without_state = {}, failed_without_reason = {}, owner_without_spooled = {},
             spooled_without_owner = {}, payload_without_spooled = {}, spool_counts = {}, total = 0}
local n = {fws = 0, fwr = 0, ows = 0, swo = 0, pws = 0, jcr = 0}
local function note(list, key, id)
  n[key] = n[key] + 1
  if #list < 5 then list[#list + 1] = id end
end
local flat = redis.call('HGETALL', KEYS[1])
local state, bare, fused, held = {}, {}, {}, {}
local function hold(job) if job then held[job] = (held[job] or 0) + 1 end end
for i = 1, #flat, 2 do
  local id, v = flat[i], flat[i + 1]
  local s = letter(v)
  state[id] = s
  local ref = s == 's' and ref_in(v)
  if ref then fused[id] = true; hold(ref_job(ref)) end
  recount[s] = (recount[s] or 0) + 1
  out.total = out.total + 1
  if s == 'f' and redis.call('HEXISTS', KEYS[3], id) == 0 then
    note(out.failed_without_reason, 'fwr', id)
    if repair then redis.call('HSET', KEYS[3], id, ARGV[2]) end
  end
  if s == 's' then
    local o = owner_in(v)
    if o == nil then  -- a bare `s`: its owner is in the spool_owner hash
      bare[id] = true
      o = redis.call('HGET', KEYS[4], id)
      if not o then
        note(out.spooled_without_owner, 'swo', id)
        if repair then redis.call('HSET', KEYS[1], id, 's:') end
      end
    end
    if o and o ~= '' then owned[o] = (owned[o] or 0) + 1 end
  end
end
local function strays(key, list, nkey)
  local h = redis.call('HKEYS', key)
  for _, id in ipairs(h) do
    local fits = (nkey == 'fws' and state[id] == 'f') or (nkey == 'ows' and bare[id])
                 or (nkey == 'pws' and state[id] == 's' and not fused[id])
    if not fits then
      note(list, nkey, id)
      if repair then
        if key == KEYS[5] then drop_ref(key, redis.call('HGET', key, id)) end
        redis.call('HDEL', key, id)
      end
    end
  end
end
strays(KEYS[3], out.failed_without_state, 'fws')
strays(KEYS[4], out.owner_without_spooled, 'ows')
strays(KEYS[5], out.payload_without_spooled, 'pws')
local rows = redis.call('HVALS', KEYS[5])  -- rows in full, and refs an older harvest kept here
for _, r in ipairs(rows) do hold(ref_job(r)) end
out.job_copies = {}
local copies = {}
for i = 3, #ARGV do copies[ARGV[i]] = true end
for job in pairs(held) do copies[job] = true end
for job in pairs(copies) do
  local copy = KEYS[5] .. ':' .. job
  local got = tonumber(redis.call('HGET', copy, 'harvest_refs')) or 0
  local want = held[job] or 0
  if want ~= got then
    out.job_copies[job] = {want, got}
    n.jcr = n.jcr + 1
    if repair and redis.call('EXISTS', copy) == 1 then  -- a copy that is gone cannot be made again
      if want > 0 then redis.call('HSET', copy, 'harvest_refs', want) else redis.call('DEL', copy) end
    end
  end
end
local counted = redis.call('HGETALL', KEYS[2])
local have = {}
for i = 1, #counted, 2 do have[counted[i]] = tonumber(counted[i + 1]) end
for _, s in ipairs({'q', 's', 'd', 'f'}) do
  local want, got = recount[s] or 0, have[s] or 0
  out.counts[s] = {want, got}
  if repair and want ~= got then redis.call('HSET', KEYS[2], s, want) end
end
local spools = redis.call('HGETALL', KEYS[6])
local seen = {}
for i = 1, #spools, 2 do
  local o, c = spools[i], tonumber(spools[i + 1])
  seen[o] = true
  if (owned[o] or 0) ~= c then
    out.spool_counts[o] = {owned[o] or 0, c}
    if repair then
      if (owned[o] or 0) > 0 then redis.call('HSET', KEYS[6], o, owned[o]) else redis.call('HDEL', KEYS[6], o) end
    end
  end
end
for o, c in pairs(owned) do
  if not seen[o] then
    out.spool_counts[o] = {c, 0}
    if repair then redis.call('HSET', KEYS[6], o, c) end
  end
end
out.n = n
return cjson.encode(out)
"""


@dataclass
class LedgerCheck:
    run: str
    total: int
    by_state: dict[str, int]  # recounted from the state hash
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        counts = ", ".join(f"{STATE_NAMES[s]} {self.by_state.get(s, 0)}" for s in STATE_NAMES)
        if self.ok:
            return [f"ledger of run {self.run}: consistent ({self.total} samples: {counts})"]
        return ([f"ledger of run {self.run}: {len(self.problems)} inconsistencies ({self.total} samples in the state "
                 f"hash: {counts})"] + [f"  {p}" for p in self.problems])


def _examples(ids: list[str]) -> str:
    return ", ".join(ids)


def check_ledger(conn: redis.Redis, run: str, repair: bool = False) -> LedgerCheck:
    """What disagrees with the state hash (and, with `repair`, rebuilt from it) in one snapshot."""
    k = Keys(run)
    why = json.dumps({"reason": WORKER_ERROR, "message": "failed without a recorded reason (found by the ledger "
                                                         "check; requeue it)"})
    skip = len(k.job_copies_match) - 1
    copies = [c.decode()[skip:] for c in conn.scan_iter(match=k.job_copies_match, count=1000)]
    raw = conn.eval(_CHECK, 6, k.state, k.counts, k.failed, k.spool_owner, k.spooled_payload, k.spool_counts,
                    "1" if repair else "0", why, *copies)
    doc = json.loads(raw)
    counts = doc["counts"] if isinstance(doc["counts"], dict) else {}
    rep = LedgerCheck(run, int(doc["total"]), {s: int(v[0]) for s, v in counts.items()})
    for s, (want, got) in sorted(counts.items()):
        if want != got:
            rep.problems.append(f"count of {STATE_NAMES[s]}: the counters say {got}, the state hash holds {want}")
    n = doc["n"]
    for key, what in (("fws", "failed_without_state"), ("fwr", "failed_without_reason"),
                      ("ows", "owner_without_spooled"), ("swo", "spooled_without_owner"),
                      ("pws", "payload_without_spooled")):
        if n[key]:
            rep.problems.append(f"{what.replace('_', ' ')}: {n[key]} (e.g. {_examples(doc[what])})")
    spool_counts = doc["spool_counts"] if isinstance(doc["spool_counts"], dict) else {}
    for spool, (want, got) in sorted(spool_counts.items()):
        rep.problems.append(f"spool {spool}: its counter says {got} spooled samples, the state hash {want}")
    copies = doc["job_copies"] if isinstance(doc["job_copies"], dict) else {}
    for job, (want, got) in sorted(copies.items()):
        rep.problems.append(f"copy of job {job}: its counter says {got} refs, the ledger holds {want}")
    return rep
