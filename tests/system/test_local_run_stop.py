"""Stopping `harvest run` as a user does: Ctrl-C typed into a real terminal (a pseudo-terminal
whose foreground process group is the runner, so the line discipline sends SIGINT to that group
exactly as a terminal would), SIGTERM to the runner alone (kill, systemd, docker stop), a second
Ctrl-C, and the runner SIGKILLed.

The README's promise: Ctrl-C or SIGTERM stops the workers (each finishes its job), then the
collector (it commits what is spooled), then the engine, the private Redis last; the same
command resumes. Nothing is left uncommitted (the spool is empty, the ledger consistent), and
no child outlives its runner."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading

import pytest
import redis

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.read.reader import RunReader
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.wait import wait_for

HANG_S = "4"  # every engine call answers after this: a job is surely in flight when ^C comes


class Terminal:
    """`harvest <args>` on a pseudo-terminal of its own, in its foreground process group."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: session leader, the pty its controlling terminal
            try:
                os.chdir(REPO)
                os.execve(sys.executable, [sys.executable, "-m", "harvest.cli", *args], {**os.environ, **env})
            finally:
                os._exit(127)
        self.out = b""
        self.status: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the terminal's last process closed it
                return
            if not chunk:
                return
            self.out += chunk

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # what the keyboard sends; the line discipline turns it into SIGINT

    def wait(self, timeout: float) -> int:
        def done():
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            return self.status is not None

        if self.status is None:
            wait_for(done, timeout, f"harvest run to exit; its terminal said:\n{self.text[-3000:]}")
        self._reader.join(10)
        return self.status

    def kill(self) -> None:
        if self.status is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run_args(tmp_path, n: int = 16) -> tuple[list[str], str]:
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(n, seed=11))
    work = str(tmp_path / "work")
    return (
        [
            "run",
            dataset,
            "--model",
            "MODEL",
            "--out",
            str(tmp_path / "out"),
            "--run",
            "stop",
            "--work-dir",
            work,
            "--dump-dir",
            str(tmp_path / "dumps"),
            "--batch-samples",
            "4",
            "--no-progress",
        ],
        work,
    )


def _private_redis(work: str) -> redis.Redis:
    """The runner's private Redis: its URL is in the work dir's lock file (harvest.cli.workdir)."""

    def url():
        try:
            with open(os.path.join(work, "runner.lock")) as f:
                return json.load(f).get("redis")
        except (OSError, ValueError):
            return None

    return redis.Redis.from_url(wait_for(url, 120, "the runner's Redis URL in runner.lock"))


def _busy_worker(conn: redis.Redis) -> bool:
    return any(conn.hget(key, "state") == b"busy" for key in conn.scan_iter(match="harvest:worker:*"))


def _log(work: str) -> list[str]:
    try:
        with open(os.path.join(work, "logs", "supervisor.log")) as f:
            return [line.split(" ", 1)[1].rstrip("\n") for line in f]
    except FileNotFoundError:
        return []


def _spool_files(work: str) -> list[str]:
    spool = os.path.join(work, "spool")
    return sorted(n for n in os.listdir(spool) if n.endswith(".safetensors")) if os.path.isdir(spool) else []


def _status(work: str) -> dict:
    res = harvest_cli("status", "--run", "stop", "--work-dir", work, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def _check(work: str) -> subprocess.CompletedProcess:
    return harvest_cli("status", "--run", "stop", "--work-dir", work, "--check")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_in_a_terminal_stops_in_order_and_leaves_nothing_uncommitted(tmp_path, tiny_model, how):
    # "sigterm": the runner's PID alone gets SIGTERM, as `kill`, systemd or `docker stop` send it
    args, work = _run_args(tmp_path)
    args[args.index("MODEL")] = tiny_model
    term = Terminal(args, {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": HANG_S})
    try:
        wait_for(lambda: _busy_worker(_private_redis(work)), 180, "a worker busy with a job")
        if how == "ctrl-c":
            term.ctrl_c()
        else:
            os.kill(term.pid, signal.SIGTERM)
        status = term.wait(240)
    finally:
        term.kill()
    assert status == 130, term.text
    assert "harvest: stopping: the workers finish their jobs, the collector commits what is spooled" in term.text
    assert (
        f"harvest: interrupted: the run's processes are stopped; run the same command again to resume (where it "
        f"stands: harvest status --run stop --work-dir {work})"
    ) in term.text
    log = _log(work)
    assert log == [
        "stopping worker-1, worker-2",
        "worker-1 stopped (exit status 0)",
        "worker-2 stopped (exit status 0)",  # each finished its job
        "stopping collector",
        "collector stopped (exit status 0)",
        "stopping engine",
        "engine stopped (exit status 0)",
        "stopping redis-server",
        "redis-server stopped (exit status 0)",
    ], log
    for name in ("worker-1", "worker-2", "collector", "engine"):
        text = open(os.path.join(work, "logs", f"{name}.log")).read()
        assert "Traceback" not in text and "Aborted!" not in text, (name, text[-2000:])
    assert _spool_files(work) == []  # the collector committed every spooled sample before it exited
    res = _check(work)
    assert res.returncode == 0 and res.stdout.startswith("ledger of run stop: consistent ("), res.stdout + res.stderr
    st = _status(work)
    assert st["spooled"] == 0 and st["done"] >= 1 and st["done"] == len(RunReader(str(tmp_path / "out" / "stop")))


def test_a_second_ctrl_c_hands_the_jobs_back_at_once(tmp_path, tiny_model):
    args, work = _run_args(tmp_path)
    args[args.index("MODEL")] = tiny_model
    term = Terminal(args, {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "600"})
    try:
        wait_for(lambda: _busy_worker(_private_redis(work)), 180, "a worker busy with a job")
        term.ctrl_c()
        try:
            wait_for(lambda: "stopping worker-1, worker-2" in _log(work), 60, "the orderly stop to begin")
        except AssertionError:
            raise AssertionError(f"no orderly stop; the terminal said:\n{term.text[-3000:]}") from None
        term.ctrl_c()
        status = term.wait(120)  # far less than the engine's 600 s answer: the jobs were handed back
    finally:
        term.kill()
    assert status == 130, term.text
    log = _log(work)
    assert log[:2] == ["stopping worker-1, worker-2", "stopping worker-1, worker-2 at once (a second interrupt)"], log
    assert log[-2:] == ["stopping redis-server", "redis-server stopped (exit status 0)"], log
    assert _spool_files(work) == []
    res = _check(work)
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    st = _status(work)  # (its dead workers' heartbeats may still count their jobs' samples in flight)
    assert st["queued"] + st["in_flight"] == st["total"] and st["done"] == st["failed"] == 0  # handed back
    assert "did not stop within" not in "\n".join(log), log


def _processes_of(*markers: str) -> list[str]:
    """Processes whose command line names one of `markers` (the test's own folder; redis-server
    rewrites its title to `redis-server 127.0.0.1:PORT`)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in markers):
            found.append(f"{pid}: {cmd}")
    return found


def test_a_sigkilled_runner_leaves_no_child_behind_and_the_same_command_resumes(tmp_path, tiny_model):
    args, work = _run_args(tmp_path, n=12)
    args[args.index("MODEL")] = tiny_model
    argv = [sys.executable, "-m", "harvest.cli", *args]
    p = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "2"},
    )
    try:
        wait_for(lambda: _busy_worker(_private_redis(work)), 180, "a worker busy with a job")
        port = _private_redis(work).connection_pool.connection_kwargs["port"]
        markers = (str(tmp_path), f"127.0.0.1:{port}")
        started = _processes_of(*markers)
        assert len(started) >= 6, started  # the runner, redis-server, the engine, 2 workers, the collector
        os.kill(p.pid, signal.SIGKILL)  # the runner alone
        p.wait()
        wait_for(lambda: not _processes_of(*markers), 60, "every child of the killed runner gone (PR_SET_PDEATHSIG)")
    finally:
        kill_group(p)
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    reader = RunReader(str(tmp_path / "out" / "stop"))  # each sample once (the reader refuses duplicates)
    n = len(reader)
    assert n >= 12 and f"samples: {n} done, 0 failed" in res.stdout
    tokens = sum(len(reader.get(s)["input_ids"]) for s in reader.sample_ids)
    assert f"  tokens: {tokens}, bytes: " in res.stdout  # counted from the index: the killed run's commits too
