"""The settle's two hot moves (harvest/state/lua/lib/hot_moves.lua `spool_job`, `commit_shard`): a
worker job's spool and a shard's commit write exactly what the general move (lua/lib/move.lua
`move`, reached through `Ledger._move` and a transaction's `mark_done`) writes from the same
ledger: the state values, the per-state counts, the spools' counts and the job copies' ref counts,
for every state a sample can be in, ids listed twice and a revoked owner included."""

import random

import pytest
import redis

from harvest.state import jobcopy
from harvest.state.ledger import ABSENT, QUEUED, SPOOLED, Ledger
from harvest.state.spools import SpoolLeases


def _job(conn, job_id: str) -> str:
    conn.hset(f"rq:job:{job_id}", mapping={"data": "x", "status": "queued"})  # what the settle copies
    return job_id


def _ledger_at(conn, run: str, ids: list[str], kinds: list[str]) -> Ledger:
    """A ledger whose samples `ids` are in the states `kinds` name: absent, q, d, f, and spooled:
    s (owned by spool `other`, a ref into job `old`), s-mine (owned by `mine`), s-none (no owner),
    s-row (owned by `other`, its row kept in full), s-bare (an older harvest's bare `s`, its owner
    and row in the side hashes)."""
    led = Ledger(conn, run)
    led.add_queued([i for i, k in zip(ids, kinds, strict=False) if k != "absent"])
    of = {
        k: [i for i, kk in zip(ids, kinds, strict=False) if kk == k]
        for k in ("s", "s-mine", "s-none", "s-row", "s-bare", "d")
    }
    old = {i: jobcopy.ref(_job(conn, "old"), n) for n, i in enumerate(ids)}
    rows = {i: f'{{"id": "{i}"}}' for i in ids}
    led.settle_job(of["s"], "other", {}, {}, refs=old)
    led.settle_job(of["s-none"], "", {}, {}, refs=old)
    led.settle_job(of["s-mine"] + of["d"], "mine", {}, {}, refs=old)
    led.settle_job(of["s-row"] + of["s-bare"], "other", rows, {})
    for i in of["s-bare"]:  # as an older harvest kept it
        conn.hset(led.keys.state, i, "s")
        conn.hset(led.keys.spool_owner, i, "other")
    led.mark_done(of["d"])
    led.mark_failed({i: ("bad-dump", "x") for i, k in zip(ids, kinds, strict=False) if k == "f"})
    values = dict(zip(ids, conn.hmget(led.keys.state, ids), strict=False))
    assert all(
        values[i].decode().startswith(("s:other@old#", "s:mine@old#", "s:@old#"))
        for i in of["s"] + of["s-mine"] + of["s-none"]
    )  # each with its ref: `old` is there to copy
    assert {values[i] for i in of["s-row"]} <= {b"s:other"} and {values[i] for i in of["s-bare"]} <= {b"s"}
    return led


def _snapshot(conn, led: Ledger, jobs: list[str]) -> dict:
    k = led.keys
    return {
        "state": conn.hgetall(k.state),
        "counts": conn.hgetall(k.counts),
        "spools": conn.hgetall(k.spool_counts),
        "owners": conn.hgetall(k.spool_owner),
        "rows": conn.hgetall(k.spooled_payload),
        "refs": {j: conn.hget(k.job_copy(j), jobcopy.REFS_FIELD) for j in jobs},
    }


KINDS = ("absent", "q", "d", "f", "s", "s-mine", "s-none", "s-row", "s-bare")
CASES = [(seed, 40, dups) for seed in range(5) for dups in (0, 5)] + [(5, 900, 300), (6, 900, 0)]


def _case(seed: int, size: int, dups: int, kinds: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """`size` ids in states drawn from `kinds`, and the ids as a call lists them: `dups` of them
    twice (with 900 ids a call spans three of the scripts' batches of 400, and an id's second
    listing another batch than its first)."""
    rng = random.Random(seed)
    ids = [f"{seed:02d}{n:030x}" for n in range(size)]
    return ids, [rng.choice(kinds) for _ in ids], ids + rng.sample(ids, dups)


@pytest.mark.parametrize("seed,size,dups", CASES)
@pytest.mark.parametrize("owner,revoked", [("mine", False), ("mine", True), ("", False)])
def test_a_jobs_spool_writes_what_the_general_move_writes(conn, seed, size, dups, owner, revoked):
    ids, kinds, listed = _case(seed, size, dups, ("q",) if seed == 0 else KINDS)  # seed 0: a job's usual samples
    job = _job(conn, f"job-{seed}")
    refs = {i: jobcopy.ref(job, n) for n, i in reversed(list(enumerate(listed)))}
    hot, general = _ledger_at(conn, f"hot{seed}", ids, kinds), _ledger_at(conn, f"gen{seed}", ids, kinds)
    if revoked:
        for led in (hot, general):
            SpoolLeases(conn, led.keys.run).revoke(owner)
    moved, failed = hot.settle_job(listed, owner, {}, {}, refs=refs)
    expected = general._move(listed, SPOOLED, QUEUED + ABSENT, [owner] * len(listed), rows=[refs[i] for i in listed])
    assert failed == []
    assert moved == expected
    assert moved == ([] if revoked else [i for i, k in zip(ids, kinds, strict=False) if k in ("absent", "q")])
    assert _snapshot(conn, hot, ["old", job]) == _snapshot(conn, general, ["old", job])
    values = [v.decode() for v in conn.hmget(hot.keys.state, moved)] if moved else []
    assert values == [f"s:{owner}@{job}#{ids.index(i)}" for i in moved]


@pytest.mark.parametrize("seed,size,dups", CASES)
@pytest.mark.parametrize("mix", ["spooled and done", "any state"])
def test_a_shards_commit_writes_what_the_general_move_writes(conn, seed, size, dups, mix):
    # Samples all spooled with a ref or done go `commit_shard`'s way; a shard with any other state or
    # form in it (a repair's commit of queued, absent or failed samples; rows kept in full; an older
    # harvest's values) goes `move`'s, and both write the same.
    ids, kinds, listed = _case(seed, size, dups, ("s", "s-mine", "s-none", "d") if mix == "spooled and done" else KINDS)
    if mix == "any state":
        kinds[: len(KINDS)] = KINDS
    hot, general = _ledger_at(conn, f"hot{seed}", ids, kinds), _ledger_at(conn, f"gen{seed}", ids, kinds)
    moved = hot.mark_done(listed, tokens=[100 + n for n in range(len(listed))])
    with conn.pipeline(transaction=True) as pipe:
        general.mark_done(listed, pipe=pipe)
        expected = [i.decode() for i in pipe.execute()[0]]
    assert moved == expected == [i for i, k in zip(ids, kinds, strict=False) if k != "d"]
    assert _snapshot(conn, hot, ["old"]) == _snapshot(conn, general, ["old"])
    assert set(conn.hvals(hot.keys.state)) == {b"d"} and hot.counts()["done"] == len(ids)
    first = {i: n for n, i in reversed(list(enumerate(listed)))}
    assert hot.stats()["tokens_done"] == sum(100 + first[i] for i in moved)


def test_a_sample_both_spooled_and_failed_by_one_settle_is_spooled(conn):
    # The failed segment moves only queued or absent samples: one the spool segment moved is not failed.
    led, job = Ledger(conn, "both"), _job(conn, "job-both")
    a, b = "a" * 32, "b" * 32
    led.add_queued([a, b])
    refs = {a: jobcopy.ref(job, 0), b: jobcopy.ref(job, 1)}
    assert led.settle_job([a], "mine", {}, {a: ("bad-dump", "x"), b: ("bad-dump", "y")}, refs=refs) == ([a], [b])
    assert led.counts() == {"queued": 0, "spooled": 1, "done": 0, "failed": 1, "total": 2}


def test_a_commit_drops_the_spools_count_and_the_jobs_copy_with_their_last_sample(conn):
    led = Ledger(conn, "last")
    ids = [f"{n:032x}" for n in range(4)]
    job = _job(conn, "job-last")
    led.add_queued(ids)
    assert led.settle_job(ids, "mine", {}, {}, refs={i: jobcopy.ref(job, n) for n, i in enumerate(ids)}) == (ids, [])
    assert conn.hget(led.keys.spool_counts, "mine") == b"4" and conn.exists(led.keys.job_copy(job))
    assert led.mark_done(ids[:3]) == ids[:3]
    assert conn.hget(led.keys.spool_counts, "mine") == b"1"
    assert conn.hget(led.keys.job_copy(job), jobcopy.REFS_FIELD) == b"1"
    assert led.mark_done(ids) == ids[3:]
    assert conn.hget(led.keys.spool_counts, "mine") is None and not conn.exists(led.keys.job_copy(job))
    assert led.counts() == {"queued": 0, "spooled": 0, "done": 4, "failed": 0, "total": 4}


def test_refs_into_one_job_go_as_their_indexes_and_nothing_else_does():
    assert jobcopy.one_job(["@hv-a#0", "@hv-a#7", "@hv-a#3"]) == ("hv-a", ["0", "7", "3"])
    assert jobcopy.one_job(["@hv-a#0", "@hv-b#1"]) is None  # two jobs
    assert jobcopy.one_job(["@hv-a#0", '{"id": "x"}']) is None  # a row kept in full
    assert jobcopy.one_job(["@hv-a#0", ""]) is None  # no row
    assert jobcopy.one_job(["@hv-a#x"]) is None
    assert jobcopy.one_job(["@a b#3"]) is None and jobcopy.one_job(["@#3"]) is None  # no job id a worker names
    assert jobcopy.one_job([]) is None


def test_a_job_is_named_only_in_a_worker_jobs_spool(conn):
    led = Ledger(conn, "bad")
    led.add_queued(["a" * 32])
    seg = ("d", "q_", False, "", "", "job-x", ["a" * 32], [], ["0"])
    with pytest.raises(
        redis.ResponseError, match="^HARVEST_BAD_SEGMENT a job is named only in the spool of a worker job$"
    ):
        led._settle([seg], {})
    assert led.states(["a" * 32]) == ["q"]
