"""The training feed following a live run, as real processes: two reader processes (ranks 0 and 1
of a 2-process gloo job, each with 2 DataLoader workers) start when about a fifth of a `harvest run` is committed;
a second node then dies with samples on its spool (SIGKILL; its samples reclaimed after the run's
grace and extracted again by the runner's node); the readers end when the runner writes settled.json,
and together they have read every sample of the run exactly once."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import pytest
from rq import Worker

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.formats.settled import read_settled
from harvest.health import healthy
from harvest.node.spooldir import spool_identity
from harvest.read.reader import RunReader
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.storage import Location
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.ops import Procs, new_run
from tests.support.wait import OutputReader, wait_for

pytestmark = pytest.mark.slow

ROWS = 40
PACE = {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "0.3"}  # each engine call takes 0.3 s more

# A rank of a 2-process gloo job, as a trainer runs it: the ranks list the live run a moment apart,
# and torch.distributed hands them rank 0's view (without it a shard committed between their
# listings would be dealt twice: harvest.read.dataset's `_agree`, CI saw 8 samples read twice).
READER = """
import json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from harvest.read import HiddenStateIterable

url, rank, rdv = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=2)
feed = HiddenStateIterable(url, seed=3, rank=rank, world_size=2, num_workers=2, follow=True, poll_s=0.2, wait_s=150)
print("view", len(feed), flush=True)
got = [x["input_ids"].tolist() for x in DataLoader(feed, batch_size=None, num_workers=2)]
print(json.dumps(got), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def test_readers_started_a_fifth_in_read_every_sample_once_through_a_node_loss(
    tmp_path, conn, redis_server, tiny_model, procs
):
    run, out = "live", f"file://{tmp_path}/out"
    url = f"{out}/{run}"
    new_run(conn, run, tiny_model, out, batch=4, spool_grace_s=6)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(ROWS, seed=5))
    ledger = Ledger(conn, run)

    # one engine serves both nodes (its dump dir shared, as workers of one host share it)
    dumps, a_spool, port = str(tmp_path / "dumps"), str(tmp_path / "spool-a"), free_port()
    engine = procs.start(
        "engine",
        "engine",
        "--model",
        tiny_model,
        "--dump-dir",
        dumps,
        "--port",
        str(port),
        "--layers",
        "eagle3",
        env=PACE,
    )
    engine_url = f"http://127.0.0.1:{port}"
    wait_for(lambda: engine.poll() is None and healthy(engine_url, 1), 120, "the engine healthy")
    # Node a: a worker that takes 2 jobs and exits, and its keeper, a worker on the same spool that
    # waits for an engine that never answers (a port bound here, never listened on), so it takes no
    # job and keeps the spool's lease alive until node a is lost. Node a's samples then wait on its
    # spool (no collector), so the run cannot finish before the readers start. An unbounded worker-a,
    # started before the runner, could take every job while a loaded machine still starts the
    # runner's worker, and nothing would ever commit (CI saw that).
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    procs.start(
        "worker-a",
        "worker",
        "--run",
        run,
        "--redis",
        redis_server.url,
        "--engine-url",
        engine_url,
        "--dump-dir",
        dumps,
        "--spool-dir",
        a_spool,
        "--node",
        "a",
        "--max-jobs",
        "2",
    )
    procs.start(
        "keeper-a",
        "worker",
        "--run",
        run,
        "--redis",
        redis_server.url,
        "--engine-url",
        f"http://127.0.0.1:{mute.getsockname()[1]}",
        "--engine-wait",
        "3600",
        "--dump-dir",
        dumps,
        "--spool-dir",
        a_spool,
        "--node",
        "a",
    )
    # worker-a waits on the queue before the runner enqueues (the keeper, waiting for its engine, never
    # registers with RQ): a loaded machine that started worker-a late let the runner's worker take every
    # job, and node a had none to lose (CI saw that)
    wait_for(lambda: Worker.count(queue=run_queue(conn, run)) >= 1, 120, "worker a waiting for jobs")

    result: dict = {}

    def runner() -> None:
        result["res"] = harvest_cli(
            "run",
            data,
            "--model",
            tiny_model,
            "--out",
            out,
            "--run",
            run,
            "--redis",
            redis_server.url,
            "--engine-url",
            engine_url,
            "--layers",
            "eagle3",
            "--dtype",
            "fp32",
            "--workers",
            "1",
            "--max-wait",
            "1",
            "--spool-grace",
            "6",
            "--work-dir",
            str(tmp_path / "work"),
            "--dump-dir",
            dumps,
            "--no-progress",
            timeout=300,
        )

    main = threading.Thread(target=runner, daemon=True)
    main.start()

    def committed() -> int:
        loc = Location.from_url(url)
        return len(RunReader(url)) if loc.exists("run.json") and loc.list("index", ".json") else 0

    wait_for(lambda: committed() >= ROWS // 5, 300, "a fifth of the run committed")
    rdv = str(tmp_path / "rdv")  # the gloo job's rendezvous file
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, url, str(rank), rdv],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    outs = [OutputReader(p.stdout) for p in readers]
    try:
        views = []
        for i, (o, p) in enumerate(zip(outs, readers, strict=False)):
            o.wait_for(lambda t: t.startswith("view "), 120, f"reader {i} open", proc=p)
            views.append(int(o.text.split()[1]))
        # Node a spooled a job (it takes 2 at most; on a loaded machine the runner's worker may leave it
        # one, and it would wait for a second for ever: CI saw that), then it is lost, its spool left as it was.
        wait_for(lambda: _spooled_on(conn, ledger, a_spool) > 0, 120, "a job of node a spooled")
        for name in ("worker-a", "keeper-a"):
            procs.procs[name].send_signal(signal.SIGKILL)
            procs.procs[name].wait()
        stranded = _spooled_on(conn, ledger, a_spool)

        main.join(300)
        res = result["res"]
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        got = []
        for o, p in zip(outs, readers, strict=False):
            assert p.wait(120) == 0, p.stderr.read()[-3000:]
            got += json.loads(o.close().strip().splitlines()[-1])
    finally:
        mute.close()
        for p in readers:
            if p.poll() is None:
                kill_group(p)

    reader = RunReader(url)
    total = ledger.counts()["total"]
    assert ledger.counts()["done"] == total == len(reader) and ledger.counts()["failed"] == 0
    stats = ledger.stats()
    assert stats["spools_reclaimed"] == 1 and stats["samples_reclaimed"] == stranded
    assert views[0] == views[1] and ROWS // 5 <= views[0] < total, views  # one view, of a run still going
    by_tokens = {tuple(reader.tokens(s)[0].tolist()): s for s in reader.sample_ids}
    read = [by_tokens[tuple(t)] for t in got]
    assert len(read) == len(set(read)) == total and sorted(read) == sorted(reader.sample_ids)
    assert read_settled(Location.from_url(url))["done"] == total


def _spooled_on(conn, ledger: Ledger, spool_dir: str) -> int:
    """Samples the spool `spool_dir` holds for the run, by the ledger."""
    return int(conn.hget(ledger.keys.spool_counts, spool_identity(spool_dir)) or 0)
