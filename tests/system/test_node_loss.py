"""Two nodes on one Redis and one output, as real processes: a node lost with samples on its
spool strands none of them, a node back within the grace commits its own, and a node whose disk
comes back after its spool was reclaimed commits nothing twice and leaves no orphan object.

A "node" is an engine, a worker and (sometimes) a collector with a spool and a dump dir of its
own; losing it is SIGKILL of all of its processes, with its spool left as it was (the disk is
withheld: nothing touches it until the node comes back)."""

import json
import os
import signal

import boto3
import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS
from harvest.node.spooldir import list_spooled, spool_identity
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.storage import Location
from tests.support.ops import Procs, cli, new_run, wait_until


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


class Node:
    def __init__(self, name, tmp_path, procs, redis_url, run, model):
        self.name, self.procs, self.redis_url, self.run, self.model = name, procs, redis_url, run, model
        self.dumps, self.spool = str(tmp_path / f"dumps-{name}"), str(tmp_path / f"spool-{name}")
        self.url = None

    def start(self, worker=True, collector=True, collector_env=None, burst_collector=False):
        if worker:
            self.url = self.url or self.procs.engine(f"engine-{self.name}", self.model, self.dumps)
            self.procs.start(
                f"worker-{self.name}",
                "worker",
                "--run",
                self.run,
                "--redis",
                self.redis_url,
                "--engine-url",
                self.url,
                "--dump-dir",
                self.dumps,
                "--spool-dir",
                self.spool,
                "--node",
                self.name,
            )
        if collector:
            self.procs.start(
                f"collector-{self.name}",
                "collect",
                "--run",
                self.run,
                "--redis",
                self.redis_url,
                "--spool-dir",
                self.spool,
                "--node",
                self.name,
                "--max-wait",
                "1",
                *(["--burst"] if burst_collector else []),
                env=collector_env,
            )

    def lose(self):
        """Every process of the node SIGKILLed at once; its spool stays as it was."""
        for n in (f"worker-{self.name}", f"collector-{self.name}", f"engine-{self.name}"):
            p = self.procs.procs.get(n)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        self.url = None

    def spool_id(self):
        return spool_identity(self.spool)

    def spooled(self, conn):
        return int(conn.hget(Ledger(conn, self.run).keys.spool_counts, self.spool_id()) or 0)


def _produce(tmp_path, conn, redis_server, tiny_model, run, out, grace, rows=24):
    cfg = new_run(conn, run, tiny_model, out, batch=4, spool_grace_s=grace)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(rows, seed=11))
    res = cli("produce", data, "--run", run, "--redis", redis_server.url)
    assert res.returncode == 0, res.stdout + res.stderr
    return cfg, Ledger(conn, run).counts()["total"]


def _spooled_then_lost(tmp_path, conn, redis_server, tiny_model, procs, run, out, grace):
    """Node a (engine and worker, no collector) spools at least 8 samples, then is lost."""
    _, total = _produce(tmp_path, conn, redis_server, tiny_model, run, out, grace=grace)
    a = Node("a", tmp_path, procs, redis_server.url, run, tiny_model)
    a.start(collector=False)  # its collector never got to commit
    wait_until(lambda: a.spooled(conn) >= 8, 120, "node a spooled 8 samples")
    a.lose()
    return total, a


def _status(run, redis_url) -> dict:
    res = cli("status", "--run", run, "--redis", redis_url, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _check_every_sample_once(conn, run, out_url, total):
    ledger = Ledger(conn, run)
    assert ledger.counts() == {"queued": 0, "spooled": 0, "done": total, "failed": 0, "total": total}
    reader = RunReader(f"{out_url}/{run}")
    assert reader.duplicates == {} and len(reader) == total  # no sample in two shards
    loc = Location.from_url(f"{out_url}/{run}")
    indexed = sorted(n.removesuffix(".json") for n in loc.list(INDEX, ".json"))
    assert sorted(n.removesuffix(".safetensors") for n in loc.list(SHARDS, ".safetensors")) == indexed  # no orphan
    # a collector clears its record just after marking the shard's samples done
    wait_until(lambda: not list(conn.scan_iter(match=f"{ledger.keys.prefix}:packing:*")), 30, "packing records cleared")


def test_a_lost_nodes_spooled_samples_are_reclaimed_and_committed_elsewhere(
    tmp_path, conn, redis_server, tiny_model, procs
):
    run, out = "lost", f"file://{tmp_path}/out"
    total, a = _spooled_then_lost(tmp_path, conn, redis_server, tiny_model, procs, run, out, grace=6)
    stranded, files = a.spooled(conn), sorted(os.listdir(a.spool))
    b = Node("b", tmp_path, procs, redis_server.url, run, tiny_model)
    b.start()
    wait_until(lambda: Ledger(conn, run).counts()["done"] == total, 240, "every sample done")
    _check_every_sample_once(conn, run, out, total)
    stats = Ledger(conn, run).stats()
    assert stats["spools_reclaimed"] == 1 and stats["samples_reclaimed"] == stranded
    st = _status(run, redis_server.url)
    assert {s["spool"]: (s["node"], s["state"], s["samples"]) for s in st["spools"]}[a.spool_id()] == (
        "a",
        "reclaimed",
        0,
    )
    assert st["spools_reclaimed"] == 1 and st["samples_reclaimed"] == stranded
    assert sorted(os.listdir(a.spool)) == files  # the lost disk was not touched


def test_a_node_back_within_the_grace_commits_its_own_samples(tmp_path, conn, redis_server, tiny_model, procs):
    run, out = "back", f"file://{tmp_path}/out"
    total, a = _spooled_then_lost(tmp_path, conn, redis_server, tiny_model, procs, run, out, grace=120)
    spool_id = a.spool_id()  # a reboot: the node restarts with its disk
    a.start()
    wait_until(lambda: Ledger(conn, run).counts()["done"] == total, 240, "every sample done")
    _check_every_sample_once(conn, run, out, total)
    assert Ledger(conn, run).stats().get("spools_reclaimed", 0) == 0 and a.spool_id() == spool_id


def test_a_disk_back_after_its_reclaim_commits_nothing_twice_and_leaves_no_orphan(
    tmp_path, conn, redis_server, tiny_model, procs, s3_bucket
):
    run, out = "late", f"{s3_bucket}/out"
    _, total = _produce(tmp_path, conn, redis_server, tiny_model, run, out, grace=6)
    a = Node("a", tmp_path, procs, redis_server.url, run, tiny_model)
    # a's collector uploads its first shard and dies before the commit fence; then the node is lost.
    # With several packers (the default), the one that got there first is any of them, and the
    # others may be mid-upload: every record stays, none decided, and one names a stored shard.
    a.start(collector_env={"HARVEST_COLLECTOR_CRASH_AT": "uploaded"})
    assert procs.wait("collector-a", 180) == -signal.SIGKILL
    a.lose()
    keys = Ledger(conn, run).keys
    recs = [
        json.loads(conn.get(k))
        for k in (keys.packing("a"), *conn.scan_iter(match=keys.packing_extra_pattern("a")))
        if conn.get(k) is not None
    ]
    assert recs and all("index" not in r and r["spool"] == a.spool_id() for r in recs)
    stored = Location.from_url(f"{out}/{run}")
    assert any(stored.exists(f"{SHARDS}/{r['shard_id']}.safetensors") for r in recs)
    b = Node("b", tmp_path, procs, redis_server.url, run, tiny_model)
    b.start()
    wait_until(lambda: Ledger(conn, run).counts()["done"] == total, 240, "every sample done")
    old_spool = a.spool_id()
    a.start(worker=False, burst_collector=True)  # the disk is back
    assert procs.wait("collector-a", 120) == 0, procs.log("collector-a")
    _check_every_sample_once(conn, run, out, total)
    assert [sid for sid, _, _ in list_spooled(a.spool)] == []  # its copies of committed samples are gone
    assert a.spool_id() != old_spool  # a revoked spool goes on under a new id
    bucket = s3_bucket.removeprefix("s3://")
    s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_an_operator_reclaims_a_node_known_to_be_gone(tmp_path, conn, redis_server, tiny_model, procs):
    run, out = "manual", f"file://{tmp_path}/out"
    total, a = _spooled_then_lost(tmp_path, conn, redis_server, tiny_model, procs, run, out, grace=3600)
    stranded = a.spooled(conn)
    res = cli("requeue", "--run", run, "--redis", redis_server.url, "--node", "a", "--dry-run")
    assert (
        res.returncode == 0
        and res.stdout == f"would reclaim spool {a.spool_id()} of node a: {stranded} spooled samples\n"
    )
    assert Ledger(conn, run).counts()["spooled"] == stranded  # a dry run changes nothing
    res = cli("requeue", "--run", run, "--redis", redis_server.url, "--node", "a")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"reclaimed spool {a.spool_id()} of node a: {stranded} samples back on the queue in ")
    res = cli("requeue", "--run", run, "--redis", redis_server.url, "--node", "zz")
    assert res.returncode == 2 and res.stderr == (
        f"harvest: error: node 'zz' has no spool in run {run} (`harvest status --run {run}` lists the spools)\n"
    )
    b = Node("b", tmp_path, procs, redis_server.url, run, tiny_model)
    b.start()
    wait_until(lambda: Ledger(conn, run).counts()["done"] == total, 240, "every sample done")
    _check_every_sample_once(conn, run, out, total)
    assert Ledger(conn, run).stats()["samples_reclaimed"] == stranded


def test_reclaim_with_redis_down_names_the_fix():
    res = cli("requeue", "--run", "r", "--node", "a", "--redis", "redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("harvest: error: cannot reach Redis at redis://127.0.0.1:1/0 (")
    assert res.stderr.endswith("start redis-server there, or pass --redis URL (default from HARVEST_REDIS_URL)\n")
