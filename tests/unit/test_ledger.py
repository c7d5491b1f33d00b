import json

import pytest

from harvest.state.heartbeat import WorkerBeat
from harvest.state.keys import worker_key
from harvest.state.ledger import Ledger


def test_transitions_keep_exact_counts(conn):
    led = Ledger(conn, "r1")
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    assert led.add_queued([a, b, c]) == [a, b, c]
    assert led.add_queued([a, b]) == []  # idempotent: known ids are left alone
    assert led.mark_spooled([a, b]) == [a, b]
    assert led.mark_failed({c: ("bad-dump", "truncated")}) == [c]
    assert led.mark_done([a]) == [a]
    assert led.counts() == {"queued": 0, "spooled": 1, "done": 1, "failed": 1, "total": 3}
    assert led.failures() == {c: {"reason": "bad-dump", "message": "truncated"}}
    assert led.mark_spooled([a]) == []  # done is final for workers
    assert led.requeue([c, a]) == [c]
    assert led.failures() == {}
    assert led.states([a, b, c, "d" * 32]) == ["d", "s", "q", None]
    assert led.counts() == {"queued": 1, "spooled": 1, "done": 1, "failed": 0, "total": 3}


def test_ledger_values_are_plain_strings(conn):
    led = Ledger(conn, "r2")
    led.add_queued(["a" * 32])
    led.mark_failed({"a" * 32: ("x", "y")})
    raw = conn.hget(led.keys.failed, "a" * 32)
    assert json.loads(raw) == {"reason": "x", "message": "y"}


def test_a_sample_the_ledger_forgot_is_taken_up_by_the_worker_that_holds_it(conn):
    # A rollback lost the enqueue of a job a worker had already dequeued (a stall unless handled): the
    # worker's spool mark and its failures still land, with exact counts, while a plain
    # mark_failed of an unknown sample (the janitor's, the stranded sweep's) changes nothing.
    led = Ledger(conn, "r3")
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    assert led.mark_spooled([a], owner="spool1", rows=['{"id": "a"}']) == [a]
    assert led.spool_owners([a]) == ["spool1"] and led.spooled_payloads([a]) == ['{"id": "a"}']
    assert led.mark_failed({b: ("bad-dump", "x")}) == []
    assert led.mark_failed({b: ("bad-dump", "x")}, forgotten=True) == [b]
    assert led.mark_failed({c: ("bad-dump", "x")}, forgotten=True) == [c]
    assert led.mark_spooled([b, c]) == []  # failed is not absent: requeue first
    assert led.counts() == {"queued": 0, "spooled": 1, "done": 0, "failed": 2, "total": 3}


def test_take_reads_the_states_with_the_heartbeats_job_line_in_one_round_trip_and_writes_nothing(conn):
    # A job's start (Ledger.take): its states, a plain HMGET sent with the heartbeat's job line
    # (which names the job's attempt); no script of the ledger's, and no write a sample.
    led = Ledger(conn, "r4")
    a, b, c, d = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    led.add_queued([a, b, c])
    led.mark_spooled([c], owner="spool1")
    beat = WorkerBeat(conn, "r4", "w-take", "node", "http://engine")
    beat.start()
    states = conn.hgetall(led.keys.state)
    before = {k: v["calls"] for k, v in conn.info("commandstats").items()}
    assert led.take([a, b, c, d], also=[beat.starting("job-1", 4, 12345)]) == ["q", "q", "s", None]
    after = {k: v["calls"] for k, v in conn.info("commandstats").items()}
    ran = {k.removeprefix("cmdstat_"): n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert (ran.pop("hmget"), ran.pop("evalsha")) == (1, 1)
    assert set(ran) <= {"info", "hset", "expire", "time"}  # the heartbeat's script's, nothing of the ledger's
    assert conn.hgetall(led.keys.state) == states
    assert conn.hget(worker_key("w-take"), "attempt") == b"12345"
    assert led.take([]) == [] and led.take([d]) == [None]
    beat.stop()


def test_enqueue_moves_an_id_listed_twice_once_and_only_new_ones(conn):
    led = Ledger(conn, "r-enq")
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    assert led.add_queued([b]) == [b]
    assert led.add_queued([a, b, a, c, c]) == [a, c]  # b is known; a and c are each counted once
    assert led.counts()["queued"] == 3 and led.states([a, b, c]) == ["q", "q", "q"]
    with conn.pipeline(transaction=True) as pipe:  # the producer's transaction: same move, no reply to read
        assert led.add_queued(["d" * 32, a], pipe=pipe) == []
        pipe.execute()
    assert led.counts()["queued"] == 4


def test_a_commits_tokens_count_only_the_samples_it_moved(conn):
    led = Ledger(conn, "r-tok")
    a, b, c, d = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    led.add_queued([a, b, c, d])
    led.mark_spooled([a, b, c, d], owner="sp")
    assert led.mark_done([a, b], tokens=[10, 20]) == [a, b]  # every sample moved: the sum sent
    assert led.stats() == {"samples_done": 2, "tokens_done": 30}
    assert led.mark_done([b, c, a, d], tokens=[20, 300, 10, 4000]) == [c, d]  # a, b were done already
    assert led.stats() == {"samples_done": 4, "tokens_done": 4330}
    assert led.mark_done([a, b], tokens=[10, 20]) == []  # a commit resent after a lost reply adds nothing
    assert led.stats() == {"samples_done": 4, "tokens_done": 4330}


def test_a_commit_the_collector_counts_itself_writes_no_stat(conn):
    """`counted=False` (the collector's commit: its tally counts): the move, its counts and the
    record cleared, and no stat, no rate bucket."""
    led = Ledger(conn, "r-unc")
    ids = [f"{i:032x}" for i in range(5)]
    led.add_queued(ids)
    led.mark_spooled(ids, owner="sp")
    conn.set("rec", "x")
    conn.sadd("recs", "rec")
    assert led.mark_done(ids[::-1] + ids[:1], clear=("rec", "recs"), counted=False) == ids[::-1]
    assert led.counts() == {"queued": 0, "spooled": 0, "done": 5, "failed": 0, "total": 5}
    assert led.stats() == {} and led.rates(60)[0] == {}
    assert conn.exists("rec") == 0 and conn.smembers("recs") == set()
    with pytest.raises(ValueError, match=r"^mark_done\(counted=False\) takes no tokens or stats$"):
        led.mark_done(ids, tokens=[1] * 5, counted=False)
