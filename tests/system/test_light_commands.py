"""The operator's light commands (`status`, `requeue`, `janitor`, `metrics`, `runs`) import
neither torch nor transformers: each is run through the real CLI under `python -X importtime`
against a real run in Redis, and the modules it imported are read from that report. (Speed
itself is measured by bench/status.py, not asserted here.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from harvest.cli.redisproc import free_port
from tests.support.cli import REPO
from tests.support.ops import new_run, wait_until

HEAVY = {"torch", "transformers"}


def _imported(stderr: str) -> set[str]:
    """Top-level packages from `-X importtime`'s report ("import time: self | cumulative | name")."""
    out = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":
                out.add(name.split(".")[0])
    return out


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of the IPv4 sockets listening on `port`."""
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # TCP_LISTEN
                out.append(addr)
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "harvest.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def run(conn, tmp_path, tiny_model) -> str:
    new_run(conn, "light", tiny_model, str(tmp_path / "out"))
    conn.hset("harvest:light:counts", mapping={"q": 2, "d": 1})
    return "light"


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--run", "{run}"],
        ["status", "--run", "{run}", "--json"],
        ["requeue", "--run", "{run}", "--all", "--dry-run"],
        ["janitor", "--run", "{run}", "--dump-dir", "{tmp}/dumps"],
        ["runs"],
    ],
    ids=lambda a: "-".join(a[:1] + a[3:4]),
)
def test_light_command_imports_no_torch(args, run, redis_server, tmp_path):
    res = _cli(*[a.format(run=run, tmp=tmp_path) for a in args], "--redis", redis_server.url)
    assert res.returncode == 0, res.stderr[-2000:]
    mods = _imported(res.stderr)
    assert "harvest" in mods and "redis" in mods  # the report is real: it lists what the command used
    assert not mods & HEAVY, sorted(mods & HEAVY)


def test_metrics_serves_a_scrape_without_torch_on_loopback(run, redis_server):
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "harvest.cli",
            "metrics",
            "--redis",
            redis_server.url,
            "--port",
            str(port),
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:

        def scrape():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                return None

        text = wait_until(scrape, 30, "the exporter answers")
        assert 'harvest_samples{run="light",state="queued"} 2.0' in text
        assert _listening(port) == ["0100007F"]  # loopback only, unless --host says otherwise
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    mods = _imported(err)
    assert "prometheus_client" in mods
    assert not mods & HEAVY, sorted(mods & HEAVY)
