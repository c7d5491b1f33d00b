"""Nodes whose clocks are 2 h off, with real processes: no node fails or strands another's job.

Two nodes, each with its reference engine, dump dir, spool and collector. Node A's first worker
takes a job and is held in it (spool backpressure: a placeholder spool file over `--max-spool-mb`,
as in test_dead_worker); node B's workers run with their clocks 2 h ahead and 2 h behind, and are
held in their jobs the same way. Every RQ worker cleans RQ's registries when it starts: with
RQ's own maintenance, B's worker that runs ahead would file A's running job as failed (its started
score, A's clock + job timeout, is 2 h in the past to it), and A's next worker would file the job
of B's worker that runs behind. Then A's worker is SIGKILLed mid-job and another starts on node A
(a scale-up): the dead worker's job is taken back by heartbeat TTL and done, and every sample is
committed exactly once (read from the index files), with no job of a healthy node in RQ's failed
registry and nothing stranded.

The shift is test-only: a `sitecustomize.py` in a temp dir, first on that worker's PYTHONPATH,
moves `time.time`, `time.time_ns`, datetime's `now`/`utcnow`/`today` (RQ's `rq.utils.now` and
`current_timestamp` read `datetime.datetime.now`) and the file times `os.stat`/`os.scandir`
report (on a real skewed node the files it stamps carry its clock too, so the worker's file-age
checks stay consistent). Monotonic clocks and Redis's TIME are the real ones.
"""

from __future__ import annotations

import glob
import json
import os
import textwrap
import time

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.ops.stranded import CHECK, SWEEP
from harvest.state.heartbeat import read_workers
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys, rq_worker_key
from harvest.state.ledger import Ledger
from harvest.state.spools import redis_time
from tests.support.ops import Procs, cli, new_run, wait_until

SHIFT_S = 7200

SITECUSTOMIZE = textwrap.dedent('''
    """Test-only (tests/system/test_clock_skew.py): this process's wall clock runs off by
    HARVEST_TEST_CLOCK_SHIFT_S seconds, the file times it reads too."""
    import datetime as _dt
    import os as _os
    import time as _time

    _S = float(_os.environ["HARVEST_TEST_CLOCK_SHIFT_S"])
    _NS = int(_S * 1e9)
    _time_real, _time_ns_real = _time.time, _time.time_ns
    _time.time = lambda: _time_real() + _S
    _time.time_ns = lambda: _time_ns_real() + _NS


    class _Datetime(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls.fromtimestamp(_time.time(), tz)

        @classmethod
        def utcnow(cls):
            return cls.utcfromtimestamp(_time.time())

        @classmethod
        def today(cls):
            return cls.fromtimestamp(_time.time())


    _dt.datetime = _Datetime


    def _shift(st):
        f = list(st[:10])
        f[7], f[8], f[9] = f[7] + int(_S), f[8] + int(_S), f[9] + int(_S)
        extra = {k: getattr(st, k) for k in ("st_blksize", "st_blocks", "st_rdev") if hasattr(st, k)}
        extra.update(st_atime=st.st_atime + _S, st_mtime=st.st_mtime + _S, st_ctime=st.st_ctime + _S,
                     st_atime_ns=st.st_atime_ns + _NS, st_mtime_ns=st.st_mtime_ns + _NS,
                     st_ctime_ns=st.st_ctime_ns + _NS)
        return _os.stat_result(f, extra)


    def _wrap(real):
        return lambda *a, **k: _shift(real(*a, **k))


    _os.stat, _os.lstat, _os.fstat = _wrap(_os.stat), _wrap(_os.lstat), _wrap(_os.fstat)


    class _Entry:
        def __init__(self, e):
            self._e = e

        def __getattr__(self, name):
            return getattr(self._e, name)

        def __fspath__(self):
            return self._e.path

        def stat(self, *, follow_symlinks=True):
            return _shift(self._e.stat(follow_symlinks=follow_symlinks))


    class _Scandir:
        def __init__(self, it):
            self._it = it

        def __iter__(self):
            return self

        def __next__(self):
            return _Entry(next(self._it))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

        def close(self):
            self._it.close()


    _scandir_real = _os.scandir
    _os.scandir = lambda *a: _Scandir(_scandir_real(*a))
''')


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _skewed_env(tmp_path, shift: int) -> dict[str, str]:
    d = tmp_path / f"clock{shift:+d}"
    d.mkdir()
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH", "")) if p),
        "HARVEST_TEST_CLOCK_SHIFT_S": str(shift),
    }


def _node(tmp_path, procs, tiny_model, name: str) -> tuple[str, str, str, str]:
    """(engine url, dump dir, spool dir, placeholder path): the placeholder holds the node's workers in their jobs."""
    dumps, spool = str(tmp_path / f"dumps-{name}"), str(tmp_path / f"spool-{name}")
    os.makedirs(spool)
    blocker = os.path.join(spool, "f" * 32 + ".safetensors")
    with open(blocker, "wb") as f:
        f.write(b"\0" * (2 << 20))
    return procs.engine(f"engine-{name}", tiny_model, dumps), dumps, spool, blocker


def _busy(conn, run, name_prefix: str, taken: set[str]) -> dict:
    def busy():
        return next(
            (
                w
                for w in read_workers(conn, run)[0]
                if w["state"] == "busy" and w["name"].startswith(name_prefix) and w["job"] not in taken
            ),
            None,
        )

    return wait_until(busy, 60, f"a worker of {name_prefix} busy with a job")


def _rq_clock_offset(conn, worker: str) -> float:
    """How far the worker's clock, as RQ wrote it (`birth`), is from Redis's."""
    from rq.utils import utcparse

    birth = utcparse(conn.hget(rq_worker_key(worker), "birth").decode()).timestamp()
    return birth - redis_time(conn)


def _committed(out: str, run: str) -> list[str]:
    ids = []
    for path in glob.glob(os.path.join(out, run, "index", "*.json")):
        with open(path) as f:
            doc = json.load(f)
        ids += [s for s in doc["samples"] if s not in doc.get("excluded", {})]
    return ids


def test_skewed_nodes_fail_or_strand_no_other_nodes_job(tmp_path, conn, redis_server, tiny_model, procs):
    t0 = time.monotonic()
    run, url, out = "skew", redis_server.url, str(tmp_path / "out")
    new_run(conn, run, tiny_model, f"file://{out}", batch=3)
    res = cli("produce", write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(18, seed=7)), "--run", run, "--redis", url)
    assert res.returncode == 0, res.stdout + res.stderr
    led, q = Ledger(conn, run), run_queue(conn, run)
    total = led.counts()["total"]
    assert total >= 12
    a_url, a_dumps, a_spool, a_block = _node(tmp_path, procs, tiny_model, "a")
    b_url, b_dumps, b_spool, b_block = _node(tmp_path, procs, tiny_model, "b")

    def worker(name: str, node: str, engine: str, dumps: str, spool: str, shift: int = 0):
        env = _skewed_env(tmp_path, shift) if shift else None
        return procs.start(
            name,
            "worker",
            "--run",
            run,
            "--redis",
            url,
            "--engine-url",
            engine,
            "--dump-dir",
            dumps,
            "--spool-dir",
            spool,
            "--node",
            node,
            "--max-spool-mb",
            "1",
            env=env,
        )

    a1 = worker("worker-a1", "node-a", a_url, a_dumps, a_spool)
    ja = _busy(conn, run, "node-a-", set())
    worker("worker-b-ahead", "node-b", b_url, b_dumps, b_spool, +SHIFT_S)  # RQ would fail A's running job here
    jb = _busy(conn, run, "node-b-", {ja["job"]})
    worker("worker-b-behind", "node-b", b_url, b_dumps, b_spool, -SHIFT_S)
    jc = _busy(conn, run, "node-b-", {ja["job"], jb["job"]})
    offsets = sorted(round(_rq_clock_offset(conn, w["name"]) / 600) * 600 for w in (ja, jb, jc))
    assert offsets == [-SHIFT_S, 0, SHIFT_S]  # RQ in those workers really reads the shifted clocks
    running = {ja["job"], jb["job"], jc["job"]}
    assert set(q.started_job_registry.get_job_ids(cleanup=False)) == running
    assert q.failed_job_registry.get_job_ids(cleanup=False) == []

    a1.kill()  # SIGKILL mid-job: its job is taken back by the heartbeat TTL, whatever the clocks
    a1.wait()
    os.unlink(a_block)
    worker("worker-a2", "node-a", a_url, a_dumps, a_spool)  # scale-up; RQ here would fail the behind worker's job
    wait_until(lambda: led.stats().get("jobs_reaped", 0) == 1, 60, f"job {ja['job']} of the killed worker taken back")
    assert q.failed_job_registry.get_job_ids(cleanup=False) == []
    assert {jb["job"], jc["job"]} <= set(q.started_job_registry.get_job_ids(cleanup=False))
    os.unlink(b_block)
    for node, spool in (("a", a_spool), ("b", b_spool)):
        procs.start(
            f"collector-{node}",
            "collect",
            "--run",
            run,
            "--redis",
            url,
            "--spool-dir",
            spool,
            "--node",
            f"node-{node}",
            "--max-wait",
            "1",
        )
    wait_until(lambda: led.counts()["done"] == total, 120, "every sample committed")

    assert led.counts() == {"queued": 0, "spooled": 0, "done": total, "failed": 0, "total": total}
    committed = _committed(out, run)
    assert sorted(committed) == sorted(k.decode() for k in conn.hkeys(Keys(run).state))  # all of them
    assert len(committed) == len(set(committed)) == total  # each exactly once
    assert led.stats()["jobs_reaped"] == 1 and "samples_stranded" not in led.stats()
    assert (q.count, q.failed_job_registry.get_job_ids(cleanup=False)) == (0, [])
    stamps = [m.decode() for m in conn.zrange(Keys(run).stranded, 0, -1)]
    assert [m for m in stamps if m not in (CHECK, SWEEP)] == [] and conn.hlen(Keys(run).suspect_executions) == 0
    print(f"\nclock skew run: {total} samples, {time.monotonic() - t0:.0f}s")
