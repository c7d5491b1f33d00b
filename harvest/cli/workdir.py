"""A `harvest run` work dir: one runner at a time, and its Redis reachable after the run.

A work dir (default `~/.cache/harvest/work/<run>`, or `$HARVEST_WORK/<run>`) holds the run's
node-local state: the private Redis's data (`redis/`, its append-only file), the spool and the
logs. Two runners on one work dir would start two redis-servers on one append-only file, two
collectors on one spool and two engines on one dump dir: the accounting of both is lost (issue
26: every sample `claimed by someone else`, a ledger whose counts say done 50 failed 50 for a
50-sample run). So a runner holds `runner.lock` in its work dir, and another in its dump dir's
parent (`<dump dir>.lock`), with `fcntl.flock` for its whole life (the kernel drops it when the
process dies, SIGKILL included, so a stale lock never blocks a rerun). The lock file holds the
holder's pid, command line and Redis URL: a second runner is refused at once, naming them.

A finished local run's Redis stops with its runner, but its data stays in `redis/`. The
operator's commands take `--work-dir DIR` (`work_dir_redis`): while a runner holds the dir they
talk to its Redis (the URL in the lock file); otherwise they take the lock themselves and start
a private redis-server on that data for the one command. Why not print the runner's URL: its
port is a free one chosen per run and its server is gone once the run ends; the work dir is what
stays.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import sys
from collections.abc import Iterator

from harvest.errors import ConfigurationError

LOCK_FILE = "runner.lock"
REDIS_SUBDIR = "redis"


class WorkDirBusy(ConfigurationError, RuntimeError):
    """Another process holds the work dir (or dump dir) this command needs."""


def default_work_dir(run: str) -> str:
    """`$HARVEST_WORK/<run>`, else `~/.cache/harvest/work/<run>`: absolute, so what the summary
    prints works from any folder."""
    base = os.environ.get("HARVEST_WORK") or os.path.join(os.path.expanduser("~"), ".cache", "harvest", "work")
    return os.path.abspath(os.path.join(base, run))


def command_line() -> str:
    """This process's command line as a user would type it (`harvest run ...`)."""
    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) in ("__main__.py", "harvest"):
        argv[0] = "harvest"
    return " ".join(shlex.quote(a) for a in argv)


class DirLock:
    """An exclusive flock on `path`, with who holds it written inside (JSON)."""

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None

    def acquire(self, **info: object) -> DirLock:
        """Take the lock now or raise WorkDirBusy naming the holder's pid and command."""
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(self.path)
            who = (
                f"pid {holder.get('pid', '?')} (`{holder.get('command', '?')}`)"
                if holder
                else "another process (it has not said which yet)"
            )
            raise WorkDirBusy(
                f"{self.what} is in use by {who}: one runner at a time; wait for it to finish or stop "
                f"it (Ctrl-C in its terminal, or kill -INT {holder.get('pid', 'PID')})"
            ) from None
        self.fd = fd
        self.update(**info)
        return self

    def update(self, **info: object) -> None:
        """Rewrite who holds it (e.g. once its private Redis has a URL)."""
        assert self.fd is not None
        doc = {"pid": os.getpid(), "command": command_line(), **info}
        data = json.dumps(doc).encode()
        try:  # written over the old bytes, then cut: on a full disk the file keeps the blocks it has
            os.pwrite(self.fd, data, 0)
            os.ftruncate(self.fd, len(data))
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise  # a full disk leaves the last holder's line: the lock itself is the flock

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock; the file stays (unlinking it would race a new holder)
            self.fd = None


def read_holder(path: str) -> dict:
    """What the holder of the lock at `path` wrote ({} while it writes, or with no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


class RunnerLocks:
    """The locks of one `harvest run`: its work dir and its dump dir."""

    def __init__(self, work: str, dumps: str, run: str) -> None:
        self.locks = [
            DirLock(os.path.join(work, LOCK_FILE), f"work dir {work} (run {run})"),
            DirLock(dumps.rstrip(os.sep) + ".lock", f"dump dir {dumps} (run {run})"),
        ]

    def acquire(self, **info: object) -> RunnerLocks:
        taken = []
        try:
            for lock in self.locks:
                taken.append(lock.acquire(**info))
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        return self

    def update(self, **info: object) -> None:
        for lock in self.locks:
            lock.update(**info)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


@contextlib.contextmanager
def work_dir_redis(work_dir: str) -> Iterator[str]:
    """The Redis URL of a local run's work dir, for one operator command: its runner's Redis
    while one runs, else a private redis-server started on the dir's data for this command
    (under the dir's lock, so no runner starts a second server on the same append-only file
    meanwhile), stopped again when the command ends."""
    from harvest.cli.redisproc import RESTART_TIMEOUT_S, RedisServer

    work = os.path.abspath(os.path.expanduser(work_dir))
    data = os.path.join(work, REDIS_SUBDIR)
    if not os.path.isdir(data):
        raise ConfigurationError(
            f"--work-dir {work_dir}: no local run's state there (no {REDIS_SUBDIR}/ folder): "
            "pass the work dir `harvest run` printed, or --redis URL for a shared Redis"
        )
    lock = DirLock(os.path.join(work, LOCK_FILE), f"work dir {work}")
    try:
        lock.acquire()
    except WorkDirBusy:
        url = read_holder(lock.path).get("redis")
        if not url:
            raise
        yield url  # a runner is live: its own Redis
        return
    server = RedisServer(data)
    try:
        server.start(timeout=RESTART_TIMEOUT_S)  # a large append-only file takes a while to load
        lock.update(redis=server.url)
        yield server.url
    finally:
        server.stop()
        lock.release()
