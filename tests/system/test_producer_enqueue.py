"""Bounded, idempotent enqueue on a real Redis, driven through the real `harvest produce` CLI.

No worker runs: the tests pop the RQ jobs themselves and move the ledger the way workers
(`q` -> `s`) and collectors (`s` -> `d`) do, so they see exactly what the producer enqueued.
"""

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from harvest.config import RunConfig, build_config
from harvest.ids import sample_id
from harvest.producer.producer import produce
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from harvest.state.runstore import publish_run
from tests.support.cli import REPO
from tests.support.wait import wait_for


def write_rows(path, n, offset=0):
    """n distinct pre-tokenized rows (ids in the tiny vocabulary) and their sample ids."""
    ids = []
    with open(path, "w") as f:
        for i in range(offset, offset + n):
            toks = [5 + i % 507, 5 + (i // 507) % 507, 5 + i // (507 * 507), 9]
            f.write(json.dumps({"input_ids": toks}) + "\n")
            ids.append(sample_id(np.array(toks), np.ones(4, np.uint8)))
    return ids


def queued_jobs(conn, run):
    """Sample ids of every job in the run's RQ queue (without taking them)."""
    q = f"rq:queue:{Keys(run).queue_name}"
    out = []
    for jid in conn.lrange(q, 0, -1):
        job = Job.fetch(jid.decode(), connection=conn, serializer=JSONSerializer)
        out.append([s.id for s in decode_batch(job.args[0])[1]])
    return out


def ledger_ids(conn, run, state):
    return {k.decode() for k, v in conn.hgetall(Keys(run).state).items() if v.decode() == state}


def drain_one(conn, run, ledger):
    """Take one job like a worker, spool and commit its samples like worker and collector; its sample ids."""
    jid = conn.lpop(f"rq:queue:{Keys(run).queue_name}")
    if jid is None:
        return None
    job = Job.fetch(jid.decode(), connection=conn, serializer=JSONSerializer)
    ids = [s.id for s in decode_batch(job.args[0])[1]]
    spooled = ledger.mark_spooled(ids)
    done = ledger.mark_done(spooled)
    job.delete()
    assert sorted(done) == sorted(ids), "a job held a sample that was not queued (enqueued twice?)"
    return ids


def _commit_in_storage(run_dir, ids: list[str]) -> None:
    from harvest.formats.index import FORMAT, encode_index
    from harvest.storage import atomic_write_local

    shard = "0" * 32
    atomic_write_local(
        str(run_dir / "index" / f"{shard}.json"),
        encode_index(
            {
                "format": FORMAT,
                "shard_id": shard,
                "shard": f"shards/{shard}.safetensors",
                "samples": ids,
                "tokens": [1] * len(ids),
                "offsets": list(range(len(ids) + 1)),
                "bytes": 0,
                "sha256": "",
                "dtype": "bf16",
                "capture_points": [2, 4, 5, 8],
                "final_state": "post-norm",
                "crc32": [[0, 0, 0]] * len(ids),
                "crc32_tensors": ["hidden_states", "input_ids", "loss_mask"],
            }
        ),
    )


def produce_cli(redis_url, dataset, run, *extra, tiny_model, out, popen=False):
    args = [
        sys.executable,
        "-m",
        "harvest.cli",
        "produce",
        str(dataset),
        "--run",
        run,
        "--redis",
        redis_url,
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
    if popen:
        return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ledger_move_and_rq_job_are_one_transaction(conn, redis_server, tokenizer, tiny_model, tmp_path):
    """MONITOR shows the ledger move (one script for all its jobs) inside MULTI/EXEC with the RQ job
    hashes and queue pushes, so a kill leaves both or neither (Redis discards a MULTI whose client
    dies before EXEC)."""
    write_rows(tmp_path / "d.jsonl", 5)
    cfg = RunConfig(
        run="m", model=tiny_model, capture_points=[2, 4], hidden_size=64, out_url=str(tmp_path), max_batch_samples=2
    )
    mon_conn = redis.Redis.from_url(redis_server.url)
    seen, ready = [], threading.Event()

    def watch():
        with mon_conn.monitor() as m:
            ready.set()
            for cmd in m.listen():
                seen.append(cmd["command"])
                if "monitor-stop" in cmd["command"]:
                    return

    th = threading.Thread(target=watch)
    th.start()
    wait_for(ready.is_set, 30, "MONITOR started (the server answered OK: it feeds every later command)")
    s = produce(conn, cfg, str(tmp_path / "d.jsonl"), tokenizer=tokenizer, progress=False)
    conn.echo("monitor-stop")
    th.join(10)
    assert (s.enqueued, s.jobs) == (5, 3)
    verbs = [c.split(" ", 1)[0].upper() for c in seen]
    txs, cur = [], None
    for verb, c in zip(verbs, seen, strict=False):
        if verb == "MULTI":
            cur = []
        elif verb == "EXEC":
            txs.append(cur)
            cur = None
        elif cur is not None:
            cur.append(c)
        else:  # outside a transaction: never a ledger move, a job hash or a queue push
            assert verb not in ("EVALSHA", "EVAL", "RPUSH", "LPUSH") and not (verb == "HSET" and "rq:job:" in c), c
    assert len(txs) == 1  # three jobs, one transaction
    tx = txs[0]
    moves = [c for c in tx if c.startswith(("EVALSHA", "EVAL "))]
    pushes = [c.split()[2] for c in tx if c.startswith("RPUSH rq:queue:harvest:m ")]
    assert len(moves) == 1 and len(pushes) == 3  # one ledger move for the transaction's three jobs
    for jid in pushes:  # each pushed job's hash, with its payload, is written in the same transaction
        assert any(c.startswith(f"HSET rq:job:{jid} ") and " data " in c for c in tx)
    assert tx[0] == "INCRBY harvest:m:enqueues 1"  # the counter other producers WATCH


def test_100k_rows_bounded_queue_drained_exactly_once_rerun_enqueues_nothing(conn, redis_server, tiny_model, tmp_path):
    n, bound = 100_000, 1000
    expected = write_rows(tmp_path / "big.jsonl", n)
    led = Ledger(conn, "big")
    peak = {"queued": 0, "llen": 0, "samples": 0}
    stop = threading.Event()

    def sample():  # another thread (and the producer is another process): the queue's depth, sampled
        c = redis.Redis.from_url(redis_server.url)
        while not stop.is_set():
            peak["queued"] = max(peak["queued"], led.counts()["queued"])
            peak["llen"] = max(peak["llen"], c.llen("rq:queue:harvest:big"))
            peak["samples"] += 1
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    proc = produce_cli(
        redis_server.url,
        tmp_path / "big.jsonl",
        "big",
        "--max-queued",
        str(bound),
        tiny_model=tiny_model,
        out=tmp_path / "out",
        popen=True,
    )
    got = Counter()
    while True:
        ids = drain_one(conn, "big", led)
        if ids is not None:
            got.update(ids)
        elif proc.poll() is not None:
            if conn.llen("rq:queue:harvest:big") == 0:
                break
        else:
            time.sleep(0.01)
    stop.set()
    sampler.join()
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert f"enqueued {n} in " in out and "skipped 0 already known; bad 0" in out
    assert 0 < peak["queued"] <= bound and peak["samples"] > 100
    assert peak["llen"] <= bound // 32 + 1
    assert set(got) == set(expected) and max(got.values()) == 1 and sum(got.values()) == n
    assert led.counts() == {"queued": 0, "spooled": 0, "done": n, "failed": 0, "total": n}

    # What storage must say for the ledger's done to stand (a producer reconciles with the index
    # files first): one index file committing every drained sample, as the collectors would.
    _commit_in_storage(tmp_path / "out" / "big", sorted(got))
    again = produce_cli(redis_server.url, tmp_path / "big.jsonl", "big", tiny_model=tiny_model, out=tmp_path / "out")
    assert again.returncode == 0, again.stderr
    assert f"enqueued 0 in 0 jobs (0 tokens), skipped {n} already known" in again.stdout
    assert conn.llen("rq:queue:harvest:big") == 0


def _assert_queue_matches_ledger(conn, run):
    """Every queued sample is in exactly one job, and every job sample is queued: nothing lost, nothing doubled."""
    in_jobs = Counter(i for job in queued_jobs(conn, run) for i in job)
    assert not in_jobs or max(in_jobs.values()) == 1
    assert set(in_jobs) == ledger_ids(conn, run, "q")
    return set(in_jobs)


def test_sigkill_mid_dataset_then_rerun_loses_and_doubles_nothing(conn, redis_server, tiny_model, tmp_path):
    n = 40_000
    expected = set(write_rows(tmp_path / "d.jsonl", n))
    led = Ledger(conn, "k")
    for kill_at in (2_000, 25_000):
        proc = produce_cli(
            redis_server.url,
            tmp_path / "d.jsonl",
            "k",
            "--max-queued",
            str(n),
            tiny_model=tiny_model,
            out=tmp_path / "out",
            popen=True,
        )
        while led.counts()["total"] < kill_at and proc.poll() is None:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert kill_at <= led.counts()["total"] < n  # killed mid-dataset
        _assert_queue_matches_ledger(conn, "k")
    done = produce_cli(
        redis_server.url, tmp_path / "d.jsonl", "k", "--max-queued", str(n), tiny_model=tiny_model, out=tmp_path / "out"
    )
    assert done.returncode == 0, done.stderr
    before = n - int(done.stdout.split("enqueued ")[1].split(" ")[0])
    assert f"skipped {before} already known" in done.stdout
    assert _assert_queue_matches_ledger(conn, "k") == expected
    assert led.counts()["queued"] == n


def test_two_producers_at_once_enqueue_each_sample_once(conn, redis_server, tiny_model, tmp_path):
    n = 20_000
    expected = set(write_rows(tmp_path / "d.jsonl", n))
    publish_run(conn, build_config("two", tiny_model, str(tmp_path / "out"), "2,4"))
    args = [
        sys.executable,
        "-m",
        "harvest.cli",
        "produce",
        str(tmp_path / "d.jsonl"),
        "--run",
        "two",
        "--redis",
        redis_server.url,
        "--max-queued",
        str(n),
        "--no-progress",
    ]
    procs = [
        subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    enq = [int(o.split("enqueued ")[1].split(" ")[0]) for o, _ in outs]
    assert sum(enq) == n
    assert _assert_queue_matches_ledger(conn, "two") == expected


def test_rerun_after_done_and_failed_enqueues_nothing(conn, tiny_model, tokenizer, tmp_path):
    """Samples spooled, done or failed are all 'known': a rerun adds no job for them."""
    ids = write_rows(tmp_path / "d.jsonl", 6)
    cfg = RunConfig(run="r", model=tiny_model, capture_points=[2, 4], hidden_size=64, out_url=str(tmp_path))
    s = produce(conn, cfg, str(tmp_path / "d.jsonl"), tokenizer=tokenizer, progress=False)
    assert (s.enqueued, s.jobs) == (6, 1)
    led = Ledger(conn, "r")
    led.mark_spooled(ids[:2])
    led.mark_done(ids[2:4])
    led.mark_failed({ids[4]: ("engine-rejected", "x")})
    conn.delete("rq:queue:harvest:r")
    s = produce(conn, cfg, str(tmp_path / "d.jsonl"), tokenizer=tokenizer, progress=False)
    assert (s.enqueued, s.skipped, s.jobs) == (0, 6, 0)
    assert conn.llen("rq:queue:harvest:r") == 0


def test_job_batches_are_bounded_by_count_and_tokens(conn, tiny_model, tokenizer, tmp_path):
    rows = [{"input_ids": [5 + i] * (1 + i % 7)} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig(
        run="b",
        model=tiny_model,
        capture_points=[2, 4],
        hidden_size=64,
        out_url=str(tmp_path),
        max_batch_samples=10,
        max_batch_tokens=20,
    )
    s = produce(conn, cfg, str(tmp_path / "d.jsonl"), tokenizer=tokenizer, progress=False)
    jobs = queued_jobs(conn, "b")
    assert s.enqueued == 200 and len(jobs) == s.jobs
    sizes = {
        sid: len(r["input_ids"])
        for sid, r in zip(
            [sample_id(np.array(r["input_ids"]), np.ones(len(r["input_ids"]), np.uint8)) for r in rows],
            rows,
            strict=False,
        )
    }
    for job in jobs:
        assert 1 <= len(job) <= 10
        assert sum(sizes[i] for i in job) <= 20 or len(job) == 1
    assert [i for job in jobs for i in job] == list(sizes)  # dataset order kept
