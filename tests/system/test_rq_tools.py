"""RQ's own monitoring tools show a harvest run as it is: `rq info` (RQ's CLI) and rq-dashboard (its
server, read through the JSON routes its pages poll and render) against the run's Redis, with real
`harvest worker` processes and a reference engine.

- Jobs queued, none running: the run's queue with its depth.
- Two workers in their jobs: the depth less two, two jobs executing (RQ's started registry), each
  worker busy on the run's queue with the job it runs.
- One worker SIGKILLed: once its heartbeat expires, the janitor takes its job back and forgets it,
  and neither tool lists it; its job is queued again.
- A job whose rows were deleted from storage: RQ fails it, and it is in the failed registry with
  its error.
- All done: nothing queued or executing, the worker idle with the counts of the jobs it ran
  (RQ keeps no finished jobs: harvest's jobs keep no result, `result_ttl` 0).

The workers are held inside their jobs by the spool backpressure (a placeholder spool file over
`--max-spool-mb`), so what runs is known when the tools are read. Every shown value is compared
with the run's own state (harvest's heartbeats, RQ's registries read by the API); a mismatch is
recorded and the test goes on, so one run names every untrue view."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.state.heartbeat import read_workers
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys
from tests.support.ops import Procs, cli, new_run, wait_until
from tests.support.rqtools import Browser, Dashboard, QueueLine, rq_info, rq_info_by_queue

SHOWN_WITHIN_S = 20  # a view the tools read may trail the run by a few of its writes, never by more


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


@pytest.fixture
def browser():
    return Browser()


@pytest.fixture
def dashboard(redis_server, tmp_path):
    d = Dashboard(redis_server.url, str(tmp_path / "rq-dashboard.log"))
    yield d
    d.close()


class Contract:
    """What the tools must show. A mismatch is recorded with what they showed, and the test goes on."""

    def __init__(self) -> None:
        self.broken: list[str] = []

    def shows(self, what: str, read: Callable[[], object], truth: object, within: float = 0) -> None:
        """`read()` (a tool's view) equals `truth`, at once or within `within` s."""
        last: list[object] = []

        def matches() -> bool:
            try:
                last[:] = [read()]
            except AssertionError as e:  # the tool failed to answer: that is what it shows
                last[:] = [f"<no answer: {str(e).splitlines()[0]}>"]
            return last[0] == truth

        try:
            wait_until(matches, within, what, poll=0.5)
        except AssertionError:
            self.broken.append(f"{what}: shows {last[0]!r}, the run has {truth!r}")


def _produce(conn, url: str, run: str, path: str, rows: list[dict]) -> list[str]:
    """`harvest produce` of `rows`: the ids of the jobs it enqueued, in queue order."""
    before = set(run_queue(conn, run).job_ids)
    res = cli("produce", write_jsonl(path, rows), "--run", run, "--redis", url)
    assert res.returncode == 0, res.stdout + res.stderr
    return [j for j in run_queue(conn, run).job_ids if j not in before]


def _rows_objects(out: str, run: str) -> set[str]:
    folder = os.path.join(out, run, "jobs")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def _busy(conn, run: str, n: int) -> dict[str, dict] | None:
    """The run's live workers by name once exactly `n` are busy (harvest's heartbeats)."""
    alive, _ = read_workers(conn, run)
    busy = {w["name"]: w for w in alive if w["state"] == "busy"}
    return busy if len(busy) == n == len(alive) else None


def _states(conn, run: str) -> dict[str, str]:
    """The run's live workers' states by name (harvest's heartbeats)."""
    return {w["name"]: w["state"] for w in read_workers(conn, run)[0]}


def test_rq_info_and_rq_dashboard_show_a_run_truthfully(tmp_path, conn, redis_server, tiny_model, procs, dashboard,
                                                        browser):
    run, url, out = "rqtools", redis_server.url, str(tmp_path / "out")
    qname = Keys(run).queue_name
    q = run_queue(conn, run)
    c = Contract()

    def info_queue() -> QueueLine | None:
        return rq_info(url, qname).queues.get(qname)

    def info_workers() -> dict[str, tuple]:
        return {w.name: (w.state, w.queues) for w in rq_info(url).workers.values()}

    def dash_queue() -> tuple[int, int, int, int] | None:
        d = dashboard.queues().get(qname)
        return d and (d["count"], d["started_job_registry_count"], d["finished_job_registry_count"],
                      d["failed_job_registry_count"])

    def dash_workers() -> dict[str, tuple]:
        return {n: (w["state"], tuple(w["queues"]), w["current_job"] if w["current_job"] == "idle"
                    else w["current_job"]["job_id"]) for n, w in dashboard.workers().items()}

    def page_queue() -> tuple[int, ...] | None:
        """The queues page's row of the run's queue, as a browser renders it: queued, deferred,
        scheduled, started, finished, failed, canceled."""
        rows = {r.cells[0]: r for r in browser.rows(f"{dashboard.base}/0/view/queues", "queue")}
        return tuple(int(c) for c in rows[qname].cells[1:]) if qname in rows else None

    def page_workers() -> dict[str, tuple]:
        """The workers page, as a browser renders it: name -> (its current job's id or "idle", its queues)."""
        seen = {}
        for r in browser.rows(f"{dashboard.base}/0/view/workers", "worker"):
            job = next((link.rsplit("/", 1)[-1] for link in r.links if "/view/job/" in link), r.cells[1])
            seen[r.cells[0]] = (job, r.cells[2])
        return seen

    def page_jobs(registry: str) -> list[str]:
        url = f"{dashboard.base}/0/view/jobs/{qname}/{registry}/8/asc/1"
        return [r.attrs["data-job-id"] for r in browser.rows(url, "job")]

    new_run(conn, run, tiny_model, f"file://{out}", batch=3)
    jobs = _produce(conn, url, run, str(tmp_path / "a.jsonl"), demo_rows(9, seed=3))
    kept = _rows_objects(out, run)
    # One more job, whose rows an operator then deletes from the run's storage: RQ fails that job.
    doomed = _produce(conn, url, run, str(tmp_path / "b.jsonl"), demo_rows(1, seed=21))
    for name in _rows_objects(out, run) - kept:
        os.unlink(os.path.join(out, run, "jobs", name))
    total = len(jobs) + len(doomed)
    assert len(doomed) == 1 and len(jobs) >= 3 and q.count == total

    # Queued, nothing running.
    c.shows("rq info: the queue before any worker", info_queue, QueueLine(total, 0, 0, 0))
    c.shows("rq-dashboard queues.json: the queue before any worker", dash_queue, (total, 0, 0, 0))
    c.shows("rq-dashboard queued jobs", lambda: [j["id"] for j in dashboard.jobs(qname, "queued")], jobs + doomed)
    c.shows("rq info: workers before any", info_workers, {})
    c.shows("rq-dashboard queues page: the queue before any worker", page_queue, (total, 0, 0, 0, 0, 0, 0))
    c.shows("rq-dashboard queued jobs page", lambda: page_jobs("queued"), (jobs + doomed)[:8])

    # Two workers, each held inside a job.
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    os.makedirs(spool)
    blocker = os.path.join(spool, "f" * 32 + ".safetensors")
    with open(blocker, "wb") as f:
        f.write(b"\0" * (2 << 20))
    engine = procs.engine("engine", tiny_model, dumps)
    worker_args = ["worker", "--run", run, "--redis", url, "--engine-url", engine, "--dump-dir", dumps,
                   "--spool-dir", spool, "--max-spool-mb", "1"]
    a = procs.start("worker-a", *worker_args)
    procs.start("worker-b", *worker_args)
    busy = wait_until(lambda: _busy(conn, run, 2), 90, "two workers busy in a job each")
    running = {n: w["job"] for n, w in busy.items()}
    assert sorted(q.started_job_registry.get_job_ids(cleanup=False)) == sorted(running.values())
    dead = next(n for n, w in busy.items() if int(w["pid"]) == a.pid)
    (alive,) = set(busy) - {dead}

    c.shows("rq info: the queue with two jobs running", info_queue, QueueLine(total - 2, 2, 0, 0))
    c.shows("rq info: two busy workers", info_workers, {n: ("busy", (qname,)) for n in busy})
    c.shows("rq info -R: the queue's workers", lambda: rq_info_by_queue(url, qname), dict.fromkeys(busy, "busy"))
    c.shows("rq-dashboard queues.json: two jobs running", dash_queue, (total - 2, 2, 0, 0))
    c.shows("rq-dashboard started jobs", lambda: sorted(j["id"] for j in dashboard.jobs(qname, "started")),
            sorted(running.values()))
    c.shows("rq-dashboard workers.json: two busy workers and their jobs", dash_workers,
            {n: ("busy", (qname,), job) for n, job in running.items()})
    c.shows("rq-dashboard queues page: two jobs running", page_queue, (total - 2, 0, 0, 2, 0, 0, 0))
    c.shows("rq-dashboard started jobs page", lambda: sorted(page_jobs("started")), sorted(running.values()))
    c.shows("rq-dashboard workers page: two busy workers and their jobs", page_workers,
            {n: (job, qname) for n, job in running.items()})

    # One worker SIGKILLed: its heartbeat expires, the janitor (in the other worker) takes its job back.
    a.send_signal(signal.SIGKILL)
    a.wait()
    wait_until(lambda: q.started_job_registry.get_job_ids(cleanup=False) == [running[alive]]
               and running[dead] in q.job_ids, 90, "the killed worker's job taken back into the queue")
    c.shows("rq info: the killed worker gone", info_workers, {alive: ("busy", (qname,))}, within=SHOWN_WITHIN_S)
    c.shows("rq info: the killed worker's job queued again", info_queue, QueueLine(total - 1, 1, 0, 0))
    c.shows("rq-dashboard queues.json: the killed worker's job queued again", dash_queue, (total - 1, 1, 0, 0))
    c.shows("rq-dashboard workers.json: the killed worker gone", dash_workers,
            {alive: ("busy", (qname,), running[alive])})
    c.shows("rq-dashboard workers page: the killed worker gone", page_workers, {alive: (running[alive], qname)})
    c.shows("rq-dashboard queues page: the killed worker's job queued again", page_queue,
            (total - 1, 0, 0, 1, 0, 0, 0))

    # Spool room again: the live worker runs every job; the one whose rows are gone fails in RQ.
    os.unlink(blocker)
    wait_until(lambda: q.count == 0 and q.started_job_registry.get_job_count(cleanup=False) == 0
               and q.failed_job_registry.get_job_ids(cleanup=False) == doomed and _states(conn, run) == {alive: "idle"},
               120, "every job run, the live worker idle")
    c.shows("rq info: the queue drained, one job failed", info_queue, QueueLine(0, 0, 0, 1))
    c.shows("rq-dashboard queues.json: the queue drained, one job failed", dash_queue, (0, 0, 0, 1))
    failed = dashboard.jobs(qname, "failed")
    c.shows("rq-dashboard failed jobs", lambda: [j["id"] for j in failed], doomed)
    c.shows("rq-dashboard failed job's error names the missing rows",
            lambda: [("are missing: deleted from the run's jobs/ folder" in (j["exc_info"] or "")) for j in failed],
            [True])
    c.shows("rq-dashboard job.json of the failed job", lambda: dashboard.job(doomed[0])["status"], "failed")
    c.shows("rq-dashboard workers.json: the live worker idle", dash_workers, {alive: ("idle", (qname,), "idle")})
    c.shows("rq-dashboard workers page: the live worker idle", page_workers, {alive: ("idle", qname)})
    c.shows("rq-dashboard queues page: the queue drained, one job failed", page_queue, (0, 0, 0, 0, 0, 1, 0))
    c.shows("rq-dashboard failed jobs page", lambda: page_jobs("failed"), doomed)
    # The live worker ran every produced job (the killed worker's too) and the failed one.
    c.shows("rq info: the live worker's job counts (finished, failed)",
            lambda: {n: (w.finished, w.failed) for n, w in rq_info(url).workers.items()},
            {alive: (len(jobs), 1)}, within=SHOWN_WITHIN_S)
    c.shows("rq-dashboard workers.json: the live worker's job counts (successful, failed)",
            lambda: {n: (w["successful_job_count"], w["failed_job_count"]) for n, w in dashboard.workers().items()},
            {alive: (len(jobs), 1)})
    assert not c.broken, "RQ's tools show the run untruthfully:\n" + "\n".join(c.broken)
