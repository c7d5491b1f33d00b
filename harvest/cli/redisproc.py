"""A private `redis-server` for `harvest run` and the tests: free port, data in a folder we own.

`harvest run` owns its Redis as it owns its other children, so a redis-server that dies is
started again by `RedisKeeper`: on the same port (every client keeps its URL and reconnects by
itself, harvest.state.connection), from the same data dir, whose append-only file brings the
ledger back (`appendfsync everysec`: a kill or a power cut may take back its last second or two,
since Redis answers before it writes while an fsync is in progress; harvest.ops.recovery
reconciles that from storage). Like the run's other children, the server runs in a session of
its own (a Ctrl-C in the terminal reaches only the runner, which stops it last, after the
collector has committed) and gets SIGTERM when the process that started it dies, even by
SIGKILL (PR_SET_PDEATHSIG; SIGTERM so that it flushes its append-only file): an orphaned server
would hold the work dir's data while the next runner starts another on it. The keeper is a thread, not a child of `harvest.cli.supervisor`,
because the run's main thread is the one waiting inside a Redis call while Redis is away.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import redis

from harvest.cli.supervisor import detached
from harvest.errors import ConfigurationError, ServiceError

log = logging.getLogger("harvest.run")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 5.0)  # between attempts to start it again; then every 5 s
RESTART_TIMEOUT_S = 120.0  # a restart replays the whole AOF before it answers


class RedisNotInstalled(ConfigurationError, RuntimeError):
    """No redis-server to start: install it, or pass --redis URL."""


class RedisServerFailed(ServiceError, RuntimeError):
    """The private redis-server exited at start, or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(
        self, data_dir: str, port: int | None = None, password: str | None = None, appendonly: bool = True
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisNotInstalled(
                "redis-server not found on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
                "macOS: brew install redis) or pass --redis URL to use a running Redis"
            )
        self.data_dir = os.path.abspath(data_dir)  # redis-server chdirs to --dir, so relative paths would break
        self.port = port or free_port()
        self.password = password
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        args = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.data_dir,
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            os.path.join(self.data_dir, "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=detached(signal.SIGTERM),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerFailed(
                    f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log"
                )
            try:
                with redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=5) as probe:
                    probe.ping()  # a server still loading its AOF answers LOADING: a ConnectionError
                return self
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.05)
        self.stop()
        raise RedisServerFailed(f"redis-server did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisKeeper(threading.Thread):
    """Keeps a `RedisServer` running: when its process exits (other than through `stop`), it is
    started again on the same port with the same data, with a backoff while that fails (the port
    still held, a disk full). `note` gets one line per event (`harvest run`'s supervisor.log)."""

    def __init__(self, server: RedisServer, note: Callable[[str], None] | None = None) -> None:
        super().__init__(name="harvest-redis-keeper", daemon=True)
        self.server, self.note = server, note or (lambda line: None)
        self.stopped = threading.Event()
        self.restarts = 0
        self.last_error = ""  # why the last restart failed ("" once one succeeded)

    def run(self) -> None:
        while not self.stopped.is_set():
            proc = self.server.proc
            if proc is None or proc.poll() is None:
                self.stopped.wait(0.2)
                continue
            self._say(
                f"redis-server on port {self.server.port} exited with status {proc.returncode}: starting it "
                f"again with its data ({self.server.data_dir})"
            )
            failures = 0
            while not self.stopped.is_set():
                try:
                    self.server.start(timeout=RESTART_TIMEOUT_S)
                except (RedisServerFailed, OSError) as e:
                    self.last_error = str(e)
                    wait = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
                    failures += 1
                    if failures == 1 or failures % 12 == 0:
                        self._say(
                            f"redis-server did not start again ({e}): trying again, every "
                            f"{RESTART_BACKOFF_S[-1]:.0f}s at most"
                        )
                    self.stopped.wait(wait)
                    continue
                self.restarts += 1
                self.last_error = ""
                self._say(f"redis-server is running again on port {self.server.port} (restart {self.restarts})")
                break

    def _say(self, line: str) -> None:
        log.warning("%s", line)
        self.note(line)

    def stop(self) -> None:
        """No more restarts (before the server itself is stopped)."""
        self.stopped.set()
        if self.is_alive():
            self.join(RESTART_TIMEOUT_S + 10)
