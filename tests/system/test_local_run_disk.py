"""A full disk under `harvest run`'s work dir (its spool and its private Redis's append-only
file), on a real small filesystem: the run pauses with one line naming the filesystem and what
fills it, goes on by itself once space returns, or stops cleanly when asked (Ctrl-C, here its
SIGINT) and the same command finishes it later."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest
import redis

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import RedisServer
from harvest.read.reader import RunReader
from harvest.state.keys import Keys
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.wait import OutputReader, wait_for

FREE_LEFT = 3 << 20  # what the filler leaves: under --min-free-mb 8


def _fill(fs: str) -> str:
    st = os.statvfs(fs)
    filler = os.path.join(fs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - FREE_LEFT))
    return filler


def _args(tmp_path, fs: str) -> tuple[list[str], str]:
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(10, seed=4))
    work = os.path.join(fs, "work")
    return (
        [
            "run",
            dataset,
            "--model",
            "MODEL",
            "--out",
            str(tmp_path / "out"),
            "--run",
            "full",
            "--work-dir",
            work,
            "--dump-dir",
            str(tmp_path / "dumps"),
            "--min-free-mb",
            "8",
            "--no-progress",
            # 5 jobs: a worker started before a pause finishes the job it took; the run's first
            # jobs must not be all of it
            "--batch-samples",
            "2",
        ],
        work,
    )


def _start(args: list[str]) -> tuple[subprocess.Popen, OutputReader, OutputReader]:
    p = subprocess.Popen(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return p, OutputReader(p.stdout), OutputReader(p.stderr)


def _paused(fs: str, work: str) -> str:
    return f"harvest: paused: the filesystem {fs} (work dir {work}) is full: "


@pytest.mark.parametrize("tiny_fs", ["48m"], indirect=True)
def test_a_full_work_dir_pauses_the_run_and_it_goes_on_when_space_returns(tmp_path, tiny_model, tiny_fs):
    args, work = _args(tmp_path, tiny_fs)
    args[args.index("MODEL")] = tiny_model
    filler = _fill(tiny_fs)
    p, stdout, err = _start(args)
    try:
        err.wait_for(lambda t: _paused(tiny_fs, work) in t, 180, "the pause line", proc=p)
        line = next(x for x in err.text.splitlines() if x.startswith(_paused(tiny_fs, work)))
        assert ", less than --min-free-mb 8; the spool (" in line and f"{work}/spool) holds " in line
        assert f"the private Redis's append-only file ({work}/redis) " in line
        assert line.endswith(
            "The workers are stopped; free space there and the run goes on by itself (at 12.0 MiB "
            "free), or Ctrl-C stops it cleanly"
        )
        assert p.poll() is None  # paused, not ended
        # full from the start: the workers were never started (a first job would have filled it more)
        assert not os.path.exists(os.path.join(work, "logs", "worker-1.log"))
        os.unlink(filler)
        p.wait(timeout=400)
    finally:
        kill_group(p)
    text, out = err.close(), stdout.close()
    assert p.returncode == 0, out + text
    assert f"harvest: resumed: the filesystem {tiny_fs} has " in text
    assert "Errno 28" not in text and "No space left" not in text
    n = len(RunReader(str(tmp_path / "out" / "full")))
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in out


@pytest.mark.parametrize("tiny_fs", ["48m"], indirect=True)
def test_a_paused_run_stops_cleanly_when_asked_and_the_same_command_finishes_it(tmp_path, tiny_model, tiny_fs):
    args, work = _args(tmp_path, tiny_fs)
    args[args.index("MODEL")] = tiny_model
    filler = _fill(tiny_fs)
    p, stdout, err = _start(args)
    try:
        err.wait_for(lambda t: _paused(tiny_fs, work) in t, 180, "the pause line", proc=p)
        p.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends it
        p.wait(timeout=240)
    finally:
        kill_group(p)
    text, out = err.close(), stdout.close()
    assert p.returncode == 130, out + text
    assert "harvest: interrupted: the run's processes are stopped; run the same command again to resume" in text
    res = harvest_cli("status", "--run", "full", "--work-dir", work, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    os.unlink(filler)
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    n = len(RunReader(str(tmp_path / "out" / "full")))
    assert f"samples: {n} done, 0 failed" in res.stdout


def _fill_to_the_last_byte(fs: str) -> str:
    """A file that takes every free block of `fs` (its last write is refused: ENOSPC)."""
    filler = os.path.join(fs, "filler")
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    assert os.statvfs(fs).f_bavail == 0
    return filler


@pytest.mark.parametrize("tiny_fs", ["48m"], indirect=True)
def test_a_work_dir_full_to_the_last_byte_mid_run_is_a_pause_and_the_run_goes_on(tmp_path, tiny_model, tiny_fs):
    """The disk fills between two looks of the run's disk watch, to the last byte: every write of
    the runner's own there (supervisor.log, the children's logs) meets ENOSPC. The Redis is given
    (--redis): its data is not on the full disk."""
    redis_server = RedisServer(str(tmp_path / "redis")).start()
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(24, seed=6))
    work = os.path.join(tiny_fs, "work")
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--run",
        "fills",
        "--work-dir",
        work,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--min-free-mb",
        "8",
        "--no-progress",
        "--batch-samples",
        "2",
        "--max-wait",
        "1",
        "--redis",
        redis_server.url,
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "1"},
    )
    stdout, err = OutputReader(p.stdout), OutputReader(p.stderr)
    conn = redis.Redis.from_url(redis_server.url)
    try:

        def mid_run() -> bool:
            assert p.poll() is None, err.text
            c = {k.decode(): int(v) for k, v in conn.hgetall(Keys("fills").counts).items()}
            return c.get("s", 0) + c.get("d", 0) >= 2 and c.get("q", 0) >= 6

        wait_for(mid_run, 240, "samples spooled, jobs still queued", poll=0.05)
        filler = _fill_to_the_last_byte(tiny_fs)
        err.wait_for(lambda t: _paused(tiny_fs, work) in t, 60, "the pause line", proc=p)
        assert p.poll() is None  # paused, not ended
        os.unlink(filler)
        p.wait(timeout=400)
    finally:
        kill_group(p)
        conn.close()
        redis_server.stop()
    text, out = err.close(), stdout.close()
    assert p.returncode == 0, out + text
    assert "Traceback" not in text and "Errno 28" not in text, text
    assert f"harvest: resumed: the filesystem {tiny_fs} has " in text
    n = len(RunReader(str(tmp_path / "out" / "fills")))
    rows = sum(1 for _ in open(dataset))
    assert n == rows and f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in out, out
    log = open(os.path.join(work, "logs", "supervisor.log")).read().splitlines()
    said = [x.split(" ", 1)[1] for x in log]
    pause = next(x for x in said if x.startswith(_paused(tiny_fs, work)))  # kept while the disk was full
    assert said.index(pause) < next(i for i, x in enumerate(said) if x.startswith("harvest: resumed: "))
