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

import dataclasses
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.state.heartbeat import read_workers
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys
from tests.support.ops import Procs, cli, new_run, wait_until
from tests.support.rqtools import Browser, Dashboard, QueueLine, rq_info, rq_info_by_queue

SHOWN_WITHIN_S = 20  # RQ's counters of a worker's jobs may trail its jobs by a few writes, never by more


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
        if (wrong := self.mismatch(what, read, truth, within)) is not None:
            self.broken.append(wrong)

    def shows_all(self, checks: list[tuple[str, Callable[[], object], object]]) -> None:
        """Each of `checks` (what, read, truth), read side by side (the views are independent and
        the run holds still meanwhile), recorded in their order."""
        with ThreadPoolExecutor(4) as pool:
            self.broken += [w for w in pool.map(lambda ch: self.mismatch(*ch), checks) if w is not None]

    @staticmethod
    def mismatch(what: str, read: Callable[[], object], truth: object, within: float = 0) -> str | None:
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
            return f"{what}: shows {last[0]!r}, the run has {truth!r}"
        return None


@dataclasses.dataclass(frozen=True)
class Truth:
    """The run as it is, read from its own records: RQ's queue and registries through RQ's API, its
    workers from harvest's heartbeats (name -> the job it runs, or "idle")."""

    queued: list[str]
    started: list[str]
    failed: list[str]
    workers: dict[str, str]

    @classmethod
    def read(cls, conn, run: str) -> Truth:
        q = run_queue(conn, run)
        alive, _ = read_workers(conn, run)
        return cls(
            q.job_ids,
            sorted(q.started_job_registry.get_job_ids(cleanup=False)),
            q.failed_job_registry.get_job_ids(cleanup=False),
            {w["name"]: w["job"] if w["state"] == "busy" else "idle" for w in alive},
        )


@dataclasses.dataclass
class Views:
    """Every view of the run's queue and workers that the tools give: `rq info` (plain, and by
    queue), rq-dashboard's JSON routes, and its pages as a headless browser renders them."""

    url: str
    queue: str
    dashboard: Dashboard
    browser: Browser

    def check(self, c: Contract, stage: str, t: Truth) -> None:
        q, d, state = self.queue, self.dashboard, {n: "idle" if j == "idle" else "busy" for n, j in t.workers.items()}
        checks: list[tuple[str, Callable[[], object], object]] = [
            (
                "rq info: the queue",
                lambda: rq_info(self.url, q).queues.get(q),
                QueueLine(len(t.queued), len(t.started), 0, len(t.failed)),
            ),
            (
                "rq info: the workers",
                lambda: {w.name: (w.state, w.queues) for w in rq_info(self.url).workers.values()},
                {n: (s, (q,)) for n, s in state.items()},
            ),
            ("rq info -R: the queue's workers", lambda: rq_info_by_queue(self.url, q), state),
            ("rq-dashboard queues.json", self._dash_queue, (len(t.queued), len(t.started), 0, len(t.failed))),
            ("rq-dashboard queued jobs", lambda: [j["id"] for j in d.jobs(q, "queued")], t.queued),
            ("rq-dashboard started jobs", lambda: sorted(j["id"] for j in d.jobs(q, "started")), t.started),
            ("rq-dashboard failed jobs", lambda: [j["id"] for j in d.jobs(q, "failed")], t.failed),
            ("rq-dashboard workers.json", self._dash_workers, {n: (state[n], (q,), j) for n, j in t.workers.items()}),
            ("rq-dashboard queues page", self._page_queue, (len(t.queued), 0, 0, len(t.started), 0, len(t.failed), 0)),
            ("rq-dashboard queued jobs page", lambda: self._page_jobs("queued"), t.queued[:8]),
            ("rq-dashboard started jobs page", lambda: sorted(self._page_jobs("started")), t.started),
            ("rq-dashboard failed jobs page", lambda: self._page_jobs("failed"), t.failed[:8]),
            ("rq-dashboard workers page", self._page_workers, {n: (j, q) for n, j in t.workers.items()}),
        ]
        c.shows_all([(f"{stage}: {what}", read, truth) for what, read, truth in checks])

    def _dash_queue(self) -> tuple[int, int, int, int] | None:
        d = self.dashboard.queues().get(self.queue)
        keys = ("count", "started_job_registry_count", "finished_job_registry_count", "failed_job_registry_count")
        return d and tuple(d[k] for k in keys)

    def _dash_workers(self) -> dict[str, tuple]:
        def job(w: dict) -> str:
            return w["current_job"] if w["current_job"] == "idle" else w["current_job"]["job_id"]

        return {n: (w["state"], tuple(w["queues"]), job(w)) for n, w in self.dashboard.workers().items()}

    def _page_queue(self) -> tuple[int, ...] | None:
        """The queues page's row of the queue: queued, deferred, scheduled, started, finished, failed, canceled."""
        rows = {r.cells[0]: r for r in self.browser.rows(f"{self.dashboard.base}/0/view/queues", "queue")}
        return tuple(int(n) for n in rows[self.queue].cells[1:]) if self.queue in rows else None

    def _page_workers(self) -> dict[str, tuple]:
        """The workers page: name -> (the id of the job it runs, or "idle"; its queues)."""
        seen = {}
        for r in self.browser.rows(f"{self.dashboard.base}/0/view/workers", "worker"):
            job = next((link.rsplit("/", 1)[-1] for link in r.links if "/view/job/" in link), r.cells[1])
            seen[r.cells[0]] = (job, r.cells[2])
        return seen

    def _page_jobs(self, registry: str) -> list[str]:
        """A registry's first page (8 jobs, oldest first)."""
        url = f"{self.dashboard.base}/0/view/jobs/{self.queue}/{registry}/8/asc/1"
        return [r.attrs["data-job-id"] for r in self.browser.rows(url, "job")]


def _produce(conn, url: str, run: str, path: str, rows: list[dict]) -> list[str]:
    """`harvest produce` of `rows`: the ids of the jobs it enqueued, in queue order."""
    before = set(run_queue(conn, run).job_ids)
    res = cli("produce", write_jsonl(path, rows), "--run", run, "--redis", url)
    assert res.returncode == 0, res.stdout + res.stderr
    return [j for j in run_queue(conn, run).job_ids if j not in before]


def _rows_objects(out: str, run: str) -> set[str]:
    folder = os.path.join(out, run, "jobs")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def test_rq_info_and_rq_dashboard_show_a_run_truthfully(
    tmp_path, conn, redis_server, tiny_model, procs, dashboard, browser
):
    run, url, out = "rqtools", redis_server.url, str(tmp_path / "out")
    views, c = Views(url, Keys(run).queue_name, dashboard, browser), Contract()
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    port = free_port()  # the engine starts while the jobs are produced
    procs.start("engine", "engine", "--model", tiny_model, "--dump-dir", dumps, "--port", str(port))
    new_run(conn, run, tiny_model, f"file://{out}", batch=3)
    jobs = _produce(conn, url, run, str(tmp_path / "a.jsonl"), demo_rows(9, seed=3))
    kept = _rows_objects(out, run)
    # One more job, whose rows an operator then deletes from the run's storage: RQ fails that job.
    doomed = _produce(conn, url, run, str(tmp_path / "b.jsonl"), demo_rows(1, seed=21))
    for name in _rows_objects(out, run) - kept:
        os.unlink(os.path.join(out, run, "jobs", name))
    assert len(doomed) == 1 and len(jobs) >= 3
    t = Truth.read(conn, run)
    assert t == Truth(jobs + doomed, [], [], {})
    views.check(c, "queued, no worker", t)

    # Two workers, each held inside a job.
    os.makedirs(spool)
    with open(os.path.join(spool, "f" * 32 + ".safetensors"), "wb") as f:
        f.write(b"\0" * (2 << 20))
    engine = f"http://127.0.0.1:{port}"  # each worker waits for it to answer before it takes a job
    args = [
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
        "--engine-wait",
        "120",
    ]
    a = procs.start("worker-a", "worker", *args, "--max-spool-mb", "1")
    procs.start("worker-b", "worker", *args, "--max-spool-mb", "1")

    def two_busy() -> Truth | None:
        t = Truth.read(conn, run)
        return t if len(t.started) == 2 and sorted(t.workers.values()) == t.started else None

    t = wait_until(two_busy, 90, "two workers busy in a job each")
    assert len(t.queued) == len(jobs) - 1
    views.check(c, "two jobs running", t)
    dead = next(w["name"] for w in read_workers(conn, run)[0] if int(w["pid"]) == a.pid)
    (alive,) = set(t.workers) - {dead}
    dead_job, alive_job = t.workers[dead], t.workers[alive]

    # One worker SIGKILLed: once its heartbeat expires, the janitor (in the other worker) takes its job
    # back and forgets it.
    a.send_signal(signal.SIGKILL)
    a.wait()

    def taken_back() -> Truth | None:
        t = Truth.read(conn, run)
        forgotten = read_workers(conn, run)[1] == []  # the janitor drops it from RQ's registry at once
        return (
            t
            if t.started == [alive_job] and dead_job in t.queued and t.workers == {alive: alive_job} and forgotten
            else None
        )

    t = wait_until(taken_back, 90, "the killed worker's job taken back into the queue, the worker forgotten")
    views.check(c, "a worker killed", t)

    # Spool room again: the live worker runs every job; the one whose rows are gone fails in RQ.
    os.unlink(os.path.join(spool, "f" * 32 + ".safetensors"))
    done = Truth([], [], doomed, {alive: "idle"})
    wait_until(lambda: Truth.read(conn, run) == done, 120, "every job run, the live worker idle")
    views.check(c, "all run", done)
    c.shows(
        "all run: rq-dashboard's failed job: its status and error",
        lambda: (lambda j: (j["status"], "are missing: deleted from the run's jobs/ folder" in j["exc_info"]))(
            dashboard.job(doomed[0])
        ),
        ("failed", True),
    )
    # The live worker ran every produced job (the killed worker's too) and the failed one.
    c.shows(
        "all run: rq info: the live worker's job counts (finished, failed)",
        lambda: {n: (w.finished, w.failed) for n, w in rq_info(url).workers.items()},
        {alive: (len(jobs), 1)},
        within=SHOWN_WITHIN_S,
    )
    c.shows(
        "all run: rq-dashboard workers.json: the live worker's job counts (successful, failed)",
        lambda: {n: (w["successful_job_count"], w["failed_job_count"]) for n, w in dashboard.workers().items()},
        {alive: (len(jobs), 1)},
    )
    assert not c.broken, "RQ's tools show the run untruthfully:\n" + "\n".join(c.broken)
