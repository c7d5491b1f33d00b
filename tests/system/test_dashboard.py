"""The Grafana dashboard kept in the repository asks a real Prometheus only questions that have
answers: Debian's `prometheus` binary (installed by .ci/run) scrapes `harvest metrics` during a
small real run (reference engine, two workers, a collector, samples the engine rejects), and
every query the dashboard JSON holds (read from the file, so the test follows the dashboard)
returns at least one finite value. The compose file's Prometheus config is checked by promtool."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time

import httpx
import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.runstore import load_run
from tests.support.need import need
from tests.support.ops import REPO, Procs, cli, enqueue, new_run, wait_until

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "dashboards", "harvest.json")
PROM_CONFIG = os.path.join(REPO, "deploy", "prometheus.yml")
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def prometheus() -> str:
    """Prometheus' binary; a test that needs it is skipped (failed under CI=true) without it."""
    if PROMETHEUS is None:
        need("prometheus", "Debian's prometheus package is not installed (.ci/run: apt-get install prometheus)")
    return PROMETHEUS


def dashboard_queries(node=None) -> list[str]:
    """Every PromQL expression in the dashboard's panels (targets' `expr`), in file order."""
    node = json.load(open(DASHBOARD)) if node is None else node
    if isinstance(node, dict):
        return ([node["expr"]] if isinstance(node.get("expr"), str) else []) + [
            q for k, v in node.items() if k != "expr" for q in dashboard_queries(v)
        ]
    if isinstance(node, list):
        return [q for v in node for q in dashboard_queries(v)]
    return []


def test_dashboard_covers_the_panels_the_issue_asks_for():
    d = json.load(open(DASHBOARD))
    titles = " | ".join(p["title"] for p in d["panels"]).lower()
    for want in (
        "queue depth",
        "samples by state",
        "samples/s",
        "tokens/s",
        "mb/s",
        "eta",
        "failed samples by reason",
        "workers per host",
        "spool backlog per node",
        "job latency",
        "engine latency",
    ):
        assert want in titles, want
    assert all(p["datasource"]["uid"] == "prometheus" for p in d["panels"])
    assert len(dashboard_queries()) >= 20
    assert [v["name"] for v in d["templating"]["list"]] == ["run"]


def test_compose_prometheus_config_is_valid():
    if shutil.which("promtool") is None:
        need("promtool", "Debian's prometheus package is not installed (.ci/run: apt-get install prometheus)")
    res = subprocess.run(["promtool", "check", "config", PROM_CONFIG], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _start_prometheus(tmp_path, target: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
        f"scrape_configs:\n  - job_name: harvest\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")
    p = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert p.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 60, "prometheus ready")
    return p, url


def _query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


@pytest.mark.usefixtures("prometheus")
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path, conn, redis_server, tiny_model, procs):
    run, url = "dash1", redis_server.url
    new_run(conn, run, tiny_model, str(tmp_path / "out"), batch=2)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(10, seed=5))
    assert cli("produce", data, "--run", run, "--redis", url).returncode == 0
    enqueue(conn, load_run(conn, run), [Sample.build([10**6, 3]), Sample.build([10**6])])  # engine-rejected

    mport = free_port()
    procs.start("metrics", "metrics", "--redis", url, "--port", str(mport), "--run", run)
    prom, purl = _start_prometheus(tmp_path, f"127.0.0.1:{mport}")
    try:
        wait_until(lambda: _query(purl, "up") and _query(purl, "up")[0]["value"][1] == "1", 60, "exporter scraped")
        dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
        engine = procs.engine("engine", tiny_model, dumps)
        for w in ("w1", "w2"):
            procs.start(
                w,
                "worker",
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
                "--node",
                "nodeA",
            )
        procs.start(
            "collector",
            "collect",
            "--run",
            run,
            "--redis",
            url,
            "--spool-dir",
            spool,
            "--node",
            "nodeA",
            "--max-wait",
            "1",
        )
        led = Ledger(conn, run)
        wait_until(
            lambda: (lambda c: c["total"] and c["done"] + c["failed"] == c["total"])(led.counts()),
            180,
            "every sample settled",
        )
        assert led.counts()["failed"] == 2
        settled = f'sum(harvest_samples{{run="{run}",state=~"done|failed"}})'  # scraped once the run settled
        wait_until(
            lambda: [s["value"][1] for s in _query(purl, settled)] == [str(led.counts()["total"])],
            60,
            "Prometheus scraping the settled run (workers and collector still alive)",
        )

        queries = [q.replace("$run", run) for q in dashboard_queries()]
        missing: dict[str, list] = {}
        deadline = time.monotonic() + 60
        for q in queries:
            while True:
                res = _query(purl, q)
                if _finite(res):
                    break
                if time.monotonic() > deadline:
                    missing[q] = res
                    break
                time.sleep(1)
        assert not missing, f"dashboard queries without data: {json.dumps(missing, indent=1)}"

        # The run picker's variable: label_values(harvest_samples, run) lists this run.
        series = httpx.get(f"{purl}/api/v1/series", params={"match[]": "harvest_samples"}, timeout=10).json()
        assert run in {s["run"] for s in series["data"]}
        # And the numbers are the run's: every sample settled, two failed by the engine's refusal.
        assert _query(purl, f'sum(harvest_samples{{run="{run}",state=~"done|failed"}})')[0]["value"][1] == str(
            led.counts()["total"]
        )
        (fail,) = _query(purl, f'harvest_failed_samples{{run="{run}"}}')
        assert (fail["metric"]["reason"], fail["value"][1]) == ("engine-rejected", "2")
    finally:
        prom.terminate()
        prom.wait(30)
