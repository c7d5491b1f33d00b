"""RQ's own monitoring tools, run as an operator runs them against a harvest Redis: `rq info` (its
raw output parsed) and rq-dashboard (a real server process, read through the JSON routes its
pages poll, and its pages as a headless Chromium renders them)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import httpx

from harvest.cli.redisproc import free_port
from tests.support.cli import REPO
from tests.support.need import need, need_module
from tests.support.wait import wait_for


@dataclasses.dataclass(frozen=True)
class QueueLine:
    """`rq info --raw`'s line of one queue: jobs waiting, and its started/finished/failed registries."""

    queued: int
    executing: int
    finished: int
    failed: int


@dataclasses.dataclass(frozen=True)
class WorkerLine:
    """`rq info --raw`'s line of one worker."""

    name: str
    pid: int
    state: str
    queues: tuple[str, ...]
    finished: int
    failed: int


_QUEUE = re.compile(r"^queue (\S+) (\d+), (\d+) executing, (\d+) finished, (\d+) failed$")
_WORKER = re.compile(r"^worker (\S+) \((\S+) (\S+) (\d+)\) (\S+) (.*)\. jobs: (\d+) finished, (\d+) failed$")


@dataclasses.dataclass(frozen=True)
class RqInfo:
    queues: dict[str, QueueLine]
    workers: dict[str, WorkerLine]


def rq_info(url: str, *queues: str) -> RqInfo:
    """`rq info --url URL --raw [QUEUES]` (RQ's own CLI, in a subprocess), parsed line by line;
    a line of neither form fails the call, so a change of RQ's format cannot pass unnoticed."""
    p = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", url, "--raw", *queues],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    qs, ws = {}, {}
    for line in p.stdout.splitlines():
        if m := _QUEUE.match(line):
            qs[m[1]] = QueueLine(*(int(m[i]) for i in range(2, 6)))
        elif m := _WORKER.match(line):
            ws[m[1]] = WorkerLine(m[1], int(m[4]), m[5], tuple(m[6].split(", ")), int(m[7]), int(m[8]))
        else:
            raise AssertionError(f"rq info printed a line of no known form: {line!r}\n{p.stdout}")
    return RqInfo(qs, ws)


def rq_info_by_queue(url: str, queue: str) -> dict[str, str]:
    """`rq info --url URL -R QUEUE`: worker name -> its state symbol, as RQ lists the queue's workers."""
    p = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", url, "--raw", "-W", "-R", queue],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"{queue}:"))
    rest = line[len(queue) + 1 :].strip()
    if rest == "–":
        return {}
    return dict(re.fullmatch(r"(\S+) \((.+)\)", w.strip()).groups() for w in rest.split(", "))


class Dashboard:
    """rq-dashboard as harvest deploys it (deploy/dashboard/rq_dashboard_json.py, JSON serializer as
    harvest's jobs are) on a free port
    of 127.0.0.1, against `redis_url`; `close()` stops it."""

    def __init__(self, redis_url: str, log_path: str) -> None:
        need_module("rq_dashboard", "rq-dashboard", "pyproject.toml's dev extra installs it")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(REPO, "deploy", "dashboard", "rq_dashboard_json.py"),
                    "--redis-url",
                    redis_url,
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--json",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.log_path = log_path

        def up() -> bool:
            assert self.proc.poll() is None, self.log()
            try:
                return httpx.get(f"{self.base}/0/data/queues.json", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "rq-dashboard answering")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path: str) -> dict:
        r = httpx.get(f"{self.base}/0/{path}", timeout=10)
        assert r.status_code == 200, f"rq-dashboard {path}: {r.status_code}\n{r.text[:2000]}\n{self.log()[-3000:]}"
        return r.json()

    def queues(self) -> dict[str, dict]:
        """queues.json: name -> count and the registries' counts, as the queues page shows them."""
        return {q["name"]: q for q in self.get("data/queues.json")["queues"]}

    def workers(self) -> dict[str, dict]:
        """workers.json: name -> state, queues, current job, counters, as the workers page shows them."""
        return {w["name"]: w for w in self.get("data/workers.json")["workers"]}

    def jobs(self, queue: str, registry: str) -> list[dict]:
        """The first page (100) of a queue's registry ("queued", "started", "failed"...), oldest first."""
        return self.get(f"data/jobs/{queue}/{registry}/100/asc/1.json")["jobs"]

    def job(self, job_id: str) -> dict:
        return self.get(f"data/job/{job_id}.json")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


@dataclasses.dataclass
class Row:
    """A table row of a rendered page: its `data-*` attributes, its cells' text, the links in it."""

    attrs: dict[str, str]
    cells: list[str] = dataclasses.field(default_factory=list)
    links: list[str] = dataclasses.field(default_factory=list)


class _Rows(HTMLParser):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role, self.rows, self._row, self._cell = role, [], None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("data-role") == self.role:
            self._row = Row({k: v or "" for k, v in a.items()})
        elif self._row is not None and tag == "td":
            self._cell = []
        elif self._row is not None and tag == "a" and a.get("href"):
            self._row.links.append(a["href"])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.cells.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None


class Browser:
    """A real headless Chromium: a page's DOM once its scripts ran (they fill rq-dashboard's tables
    from its JSON routes)."""

    def __init__(self) -> None:
        self.binary = next((b for b in map(shutil.which, BROWSERS) if b), None)
        if self.binary is None:
            need(
                "a headless Chromium",
                f"none of {', '.join(BROWSERS)} on PATH (.ci/run installs Debian's chromium-headless-shell)",
            )

    def dom(self, url: str) -> str:
        p = subprocess.run(
            [
                self.binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--virtual-time-budget=5000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0 and "<html" in p.stdout, f"{self.binary} {url}: {p.returncode}\n{p.stderr[-2000:]}"
        return p.stdout

    def rows(self, url: str, role: str) -> list[Row]:
        """The rows `<tr data-role=ROLE>` of the page at `url` as rendered."""
        parser = _Rows(role)
        parser.feed(self.dom(url))
        return parser.rows
