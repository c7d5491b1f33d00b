"""harvest.atomic (a local file whole or not at all) and harvest.health (an engine's /health)."""

from __future__ import annotations

import http.server
import os
import stat
import threading

import pytest

from harvest.atomic import atomic_path, write_atomic
from harvest.health import healthy, wait_healthy


def test_written_whole_from_pieces_readable_by_others_and_no_temp_left(tmp_path):
    path = str(tmp_path / "f.json")
    assert write_atomic(path, [b"ab", memoryview(b"cd")], prefix=".tmp-", fsync_dir=True)
    assert open(path, "rb").read() == b"abcd"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["f.json"]
    assert write_atomic(path, b"new", prefix=".tmp-")  # replaces
    assert open(path, "rb").read() == b"new"


def test_exclusive_keeps_what_is_there(tmp_path):
    path = str(tmp_path / "claim")
    assert write_atomic(path, b"first", prefix=".tmp-", exclusive=True)
    assert not write_atomic(path, b"second", prefix=".tmp-", exclusive=True)
    assert open(path, "rb").read() == b"first" and os.listdir(tmp_path) == ["claim"]


def test_a_failed_write_leaves_neither_file_nor_temp(tmp_path):
    def pieces():
        yield b"part"
        raise OSError("disk full")

    path = str(tmp_path / "f")
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, pieces(), temp=str(tmp_path / ".tmp-f.1"))
    assert os.listdir(tmp_path) == []


def test_exactly_one_temp_name():
    with pytest.raises(ValueError):
        write_atomic("x", b"", prefix=".a", temp="y")
    with pytest.raises(ValueError):
        write_atomic("x", b"")


@pytest.fixture
def server():
    class Handler(http.server.BaseHTTPRequestHandler):
        status = 503

        def do_GET(self):  # noqa: N802
            self.send_response(Handler.status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", Handler
    srv.shutdown()
    srv.server_close()


def test_wait_healthy_waits_for_200_and_runs_the_check(server):
    url, handler = server
    assert not healthy(url, 2)
    assert not wait_healthy(url, 0.3, interval=0.05)
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 3:
            handler.status = 200

    assert wait_healthy(url, 30, interval=0.01, check=check) and len(checks) == 3
    assert healthy(url, 2)


def test_wait_healthy_stops_when_the_check_raises_and_refused_is_unhealthy():
    def exited():
        raise RuntimeError("engine exited")

    with pytest.raises(RuntimeError, match="engine exited"):
        wait_healthy("http://127.0.0.1:9", None, check=exited)
    assert not healthy("http://127.0.0.1:9", 1)


def test_atomic_path_for_writers_that_take_a_name(tmp_path):
    path = str(tmp_path / "a.bin")
    with atomic_path(path, prefix=".tmp-", fsync_dir=True) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and not os.path.exists(path)
        with open(tmp, "wb") as f:
            f.write(b"x")
    assert open(path, "rb").read() == b"x" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with pytest.raises(RuntimeError), atomic_path(str(tmp_path / "b.bin"), prefix=".tmp-") as tmp:
        open(tmp, "wb").close()
        raise RuntimeError("writer failed")
    assert os.listdir(tmp_path) == ["a.bin"]
