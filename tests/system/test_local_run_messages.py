"""What `harvest run` and its neighbours say when something is wrong, as a user meets it: a bare
model name with no such folder and no hub (one line, within seconds, naming --model PATH), a
Redis that is up but still loading its data after a restart (not "start redis-server there"),
and a read-only output (the collector's own "collector stopped" line, no traceback, exit 77;
`harvest run` stops the whole run at the collector's first refusal with that line, never
restarting it into the same wall, and the same command finishes the run once the output takes
writes again)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.formats.index import INDEX, committed_samples
from harvest.storage import Location
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.wait import OutputReader, wait_for


def test_a_bare_model_name_is_refused_at_once_naming_model_path(tmp_path):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(3))
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = harvest_cli("run", dataset, "--model", "tiny", "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert time.monotonic() - t0 < 10 + 20  # imports included, on a loaded machine: far from the hub's 44 s
    assert res.returncode == 2
    assert res.stderr == (
        "harvest: error: model 'tiny' is not a folder on this machine, and the reference engine "
        "loads only local models: pass --model PATH, a Hugging Face model folder\n"
    )
    assert not out.exists() and not (tmp_path / "work").exists()


def test_a_bare_model_name_with_no_hub_reachable_gets_one_line_within_seconds(tmp_path):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(3))
    dead = f"http://127.0.0.1:{free_port()}"  # a hub endpoint nothing listens on
    t0 = time.monotonic()
    res = harvest_cli(
        "produce",
        dataset,
        "--run",
        "bare",
        "--model",
        "tiny",
        "--dry-run",
        env={"HF_ENDPOINT": dead, "HF_HUB_OFFLINE": "0"},
    )
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith(
        f"harvest: error: model 'tiny' is not a folder on this machine, and the model hub ({dead}) cannot be reached ("
    )
    assert res.stderr.endswith("): pass --model PATH, a local Hugging Face model folder\n")
    assert res.stderr.count("\n") == 1 and took < 30, (took, res.stderr)
    res = harvest_cli("produce", dataset, "--run", "bare", "--model", "tiny", "--dry-run", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2
    assert res.stderr == (
        "harvest: error: model 'tiny' is not a folder on this machine, and the model hub is off "
        "(HF_HUB_OFFLINE): pass --model PATH, a local Hugging Face model folder\n"
    )


class LoadingRedis:
    """A TCP server answering every command as a redis-server replaying its append-only file does
    (`-LOADING`): the state a restarted Redis is in for as long as its file takes to load."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(c,), daemon=True).start()

    @staticmethod
    def _answer(c: socket.socket) -> None:
        with c:
            while c.recv(65536):
                c.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")

    def close(self) -> None:
        self.sock.close()


def test_a_redis_still_loading_after_a_restart_is_not_told_to_be_started(tmp_path):
    server = LoadingRedis()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        res = harvest_cli("status", "--run", "r", "--redis", url)
    finally:
        server.close()
    assert res.returncode == 2
    assert res.stderr == (
        f"harvest: error: Redis at {url} is running but still loading its data (a restarted server "
        "replays its append-only file first): run the command again once it has loaded\n"
    )


@pytest.mark.parametrize("tiny_fs", ["16m"], indirect=True)
def test_a_read_only_output_stops_the_collector_with_its_own_line(tmp_path, tiny_model, tiny_fs, redis_server, conn):
    from harvest.config import build_config
    from harvest.state.runstore import publish_run

    out = os.path.join(tiny_fs, "out")
    publish_run(conn, build_config("ro", tiny_model, out))  # the run exists; then its output turns read-only
    subprocess.run(["mount", "-o", "remount,ro", tiny_fs], check=True)
    res = harvest_cli(
        "collect", "--run", "ro", "--redis", redis_server.url, "--spool-dir", str(tmp_path / "spool"), "--burst"
    )
    assert res.returncode == 77, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr == (
        f"harvest: error: collector stopped: preparing {out}/ro/shards failed: OSError: [Errno 30] "
        f"Read-only file system: '{out}/ro/shards'. The spool in {tmp_path / 'spool'} is intact and "
        "the shard in progress is recorded in Redis; fix the storage and start the collector again "
        "(`harvest collect`, or the same `harvest run`) to finish it.\n"
    )


def _remount(fs: str, mode: str) -> None:
    """`mount -o remount,<mode>`; a remount read-only waits out EBUSY (a file still open for writing)."""

    def done():
        return subprocess.run(["mount", "-o", f"remount,{mode}", fs], capture_output=True).returncode == 0

    wait_for(done, 30, f"{fs} remounted {mode}")


@pytest.mark.parametrize("tiny_fs", ["64m"], indirect=True)
def test_an_output_turned_read_only_stops_harvest_run_at_once_and_the_same_command_finishes_it(
    tmp_path, tiny_model, tiny_fs
):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(24, seed=6))
    out = os.path.join(tiny_fs, "out")
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        out,
        "--run",
        "ro",
        "--work-dir",
        str(tmp_path / "work"),
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-progress",
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stdout, err = OutputReader(p.stdout), OutputReader(p.stderr)
    try:
        wait_for(
            lambda: os.path.exists(os.path.join(out, "ro", "run.json")) or p.poll() is not None,
            120,
            "the run's run.json",
        )
        _remount(tiny_fs, "ro")  # after the runner's own writes, before the collector's first
        p.wait(timeout=300)
    finally:
        kill_group(p)
    text = err.close()
    stdout.close()
    assert p.returncode == 77, text
    assert "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("harvest: error: the run stopped because its collector stopped: "), text
    assert "OSError: [Errno 30] Read-only file system" in last, last
    assert last.endswith(
        f"The spool in {tmp_path / 'work' / 'spool'} is intact and the shard in progress is recorded "
        "in Redis; fix the storage and start the collector again (`harvest collect`, or the same "
        "`harvest run`) to finish it."
    ), last
    with open(tmp_path / "work" / "logs" / "supervisor.log") as f:
        log = f.read()
    assert "collector exited with status" not in log, log  # stopped at its first refusal: never restarted

    _remount(tiny_fs, "rw")
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    loc = Location.from_url(os.path.join(out, "ro"))  # the index files themselves: a reader hides a duplicate
    copies = Counter(s for n in loc.list(INDEX, ".json") for s in committed_samples(loc.read_json(f"{INDEX}/{n}")))
    assert copies and set(copies.values()) == {1}, copies
    assert f"samples: {len(copies)} done, 0 failed" in res.stdout, res.stdout
