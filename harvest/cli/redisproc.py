"""A private `redis-server` for `harvest run` and the tests: free port, data in a folder we own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import redis


class RedisNotInstalled(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, data_dir: str, port: int | None = None, password: str | None = None, appendonly: bool = True) -> None:
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
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", self.data_dir,
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--logfile", os.path.join(self.data_dir, "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

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

    def __exit__(self, *exc) -> None:
        self.stop()
