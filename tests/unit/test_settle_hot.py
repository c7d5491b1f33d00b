"""The settle's two hot moves (harvest.state.settle_lua `spool_job`, `commit_shard`): a worker job's
spool and a shard's commit write exactly what the general move (ledger_lua `move`, reached through
`Ledger._move` and a transaction's `mark_done`) writes from the same ledger: the state values,
the per-state counts, the spools' counts and the job copies' ref counts, for every state a
sample can be in, ids listed twice and a revoked owner included."""

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
    """A ledger whose samples `ids` are in the states `kinds` name: absent, q, s (owned by spool
    `other`, a ref into job `old`), s-mine (owned by `mine`), s-none (spooled with no owner), d, f."""
    led = Ledger(conn, run)
    known = [i for i, k in zip(ids, kinds) if k != "absent"]
    led.add_queued(known)
    spooled = {k: [i for i, kk in zip(ids, kinds) if kk == k] for k in ("s", "s-mine", "s-none", "d")}
    old = {i: jobcopy.ref(_job(conn, "old"), n) for n, i in enumerate(ids)}
    led.settle_job(spooled["s"], "other", {}, {}, refs=old)
    led.settle_job(spooled["s-none"], "", {}, {}, refs=old)
    led.settle_job(spooled["s-mine"] + spooled["d"], "mine", {}, {}, refs=old)
    led.mark_done(spooled["d"])
    led.mark_failed({i: ("bad-dump", "x") for i, k in zip(ids, kinds) if k == "f"})
    spooled = [i for i, k in zip(ids, kinds) if k.startswith("s")]  # each with its ref: `old` is there to copy
    values = conn.hmget(led.keys.state, spooled) if spooled else []
    assert all(v.decode().startswith(("s:other@old#", "s:mine@old#", "s:@old#")) for v in values)
    return led


def _snapshot(conn, led: Ledger, jobs: list[str]) -> dict:
    return {"state": conn.hgetall(led.keys.state), "counts": conn.hgetall(led.keys.counts),
            "spools": conn.hgetall(led.keys.spool_counts),
            "refs": {j: conn.hget(led.keys.job_copy(j), jobcopy.REFS_FIELD) for j in jobs}}


KINDS = ("absent", "q", "s", "s-mine", "s-none", "d", "f")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("revoked", [False, True])
def test_a_jobs_spool_writes_what_the_general_move_writes(conn, seed, revoked):
    rng = random.Random(seed)
    ids = [f"{seed:02d}{n:030x}" for n in range(40)]
    kinds = [rng.choice(KINDS) if seed else "q" for _ in ids]  # seed 0: a job's usual samples, all queued
    listed = ids + rng.sample(ids, 5)  # five listed twice
    job = _job(conn, f"job-{seed}")
    refs = {i: jobcopy.ref(job, n) for n, i in reversed(list(enumerate(listed)))}
    hot, general = _ledger_at(conn, f"hot{seed}", ids, kinds), _ledger_at(conn, f"gen{seed}", ids, kinds)
    if revoked:
        for led in (hot, general):
            SpoolLeases(conn, led.keys.run).revoke("mine")
    moved, failed = hot.settle_job(listed, "mine", {}, {}, refs=refs)
    expected = general._move(listed, SPOOLED, QUEUED + ABSENT, ["mine"] * len(listed), rows=[refs[i] for i in listed])
    assert failed == []
    assert moved == expected
    assert moved == ([] if revoked else [i for i, k in zip(ids, kinds) if k in ("absent", "q")])
    assert _snapshot(conn, hot, ["old", job]) == _snapshot(conn, general, ["old", job])
    values = [v.decode() for v in conn.hmget(hot.keys.state, moved)] if moved else []
    assert values == [f"s:mine@{job}#{ids.index(i)}" for i in moved]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", ["spooled and done", "one of each state"])
def test_a_shards_commit_writes_what_the_general_move_writes(conn, seed, mix):
    # Samples all spooled with a ref or done go `commit_shard`'s way; a shard with any other state in
    # it (queued, absent, failed: a repair's commit) goes `move`'s, and both write the same.
    rng = random.Random(seed)
    ids = [f"{seed:02d}{n:030x}" for n in range(40)]
    kinds = [rng.choice(("s", "s-mine", "s-none", "d") if mix == "spooled and done" else KINDS) for _ in ids]
    if mix == "one of each state":
        kinds[:len(KINDS)] = KINDS
    listed = ids + rng.sample(ids, 5)
    hot, general = _ledger_at(conn, f"hot{seed}", ids, kinds), _ledger_at(conn, f"gen{seed}", ids, kinds)
    moved = hot.mark_done(listed, tokens=[100 + n for n in range(len(listed))])
    with conn.pipeline(transaction=True) as pipe:
        general.mark_done(listed, pipe=pipe)
        expected = [i.decode() for i in pipe.execute()[0]]
    assert moved == expected == [i for i, k in zip(ids, kinds) if k != "d"]
    assert _snapshot(conn, hot, ["old"]) == _snapshot(conn, general, ["old"])
    assert set(conn.hvals(hot.keys.state)) == {b"d"} and hot.counts()["done"] == len(ids)
    first = {i: n for n, i in reversed(list(enumerate(listed)))}
    assert hot.stats()["tokens_done"] == sum(100 + first[i] for i in moved)


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
    assert jobcopy.one_job([]) is None


def test_a_job_is_named_only_in_a_worker_jobs_spool(conn):
    led = Ledger(conn, "bad")
    led.add_queued(["a" * 32])
    seg = ("d", "q_", False, "", "", "job-x", ["a" * 32], [], ["0"])
    with pytest.raises(redis.ResponseError, match="^HARVEST_BAD_SEGMENT a job is named only in the spool of a worker job$"):
        led._settle([seg], {})
    assert led.states(["a" * 32]) == ["q"]
