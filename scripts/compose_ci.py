"""Helpers of scripts/compose_ci.sh (the docker-compose deployment run for real in CI).

    python scripts/compose_ci.py pip-conf SERVE_DIR URL CONSTRAINTS
        the host's pip sources as a pip.conf for images built here (local dirs served at URL), and
        the host's installed versions as pip constraints for them (written to CONSTRAINTS)
    python scripts/compose_ci.py render < CONFIG > FILE  the merged config, runnable on the host network
    python scripts/compose_ci.py workers NAME=PID...   each worker container's RQ worker and its job
    python scripts/compose_ci.py job JOB_ID            where a job is (RQ status and worker, or gone)
    python scripts/compose_ci.py counts                the ledger's counts and stats
    python scripts/compose_ci.py verify MODEL DATASET OUT_URL
        every row of DATASET stored exactly once in OUT_URL with the right tokens and loss mask

Redis and the run come from HARVEST_REDIS_URL and CI_RUN; the object store from
HARVEST_S3_ENDPOINT and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.

CI only: nothing in harvest imports this file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # harvest and tests.support from this checkout


IMAGE_CONSTRAINTS = "/etc/pip-constraints.txt"  # where the CI base image holds them
# compose.ci.yml's S3 store is moto's server, installed into the harvest image unpinned (its
# EXTRA_PACKAGES): its one version is the host's, through these constraints.
IMAGE_PINNED_BY_HOST = ("moto",)


def host_constraints(freeze: str | None = None) -> str:
    """The versions installed here (`freeze`: `pip freeze`'s output, default this interpreter's),
    where the suite passes, as constraints: the images resolve to the same set, and pip never
    backtracks through botocore releases. moto's version is taken from here alone (compose.ci.yml
    names no version), so a host with another moto builds images with that one; a host without
    moto is refused, naming the fix."""
    if freeze is None:
        freeze = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
        ).stdout
    pins = [line for line in freeze.splitlines() if "==" in line and not line.startswith("-")]
    names = {re.split(r"[=\[ ]", line, maxsplit=1)[0].lower().replace("_", "-") for line in pins}
    missing = [p for p in IMAGE_PINNED_BY_HOST if p not in names]
    if missing:
        raise SystemExit(
            f"compose_ci.py: {', '.join(missing)} not installed here: the CI images take its version from "
            "this host; pip install -e '.[dev]' first"
        )
    return "".join(line + "\n" for line in pins)


def pip_conf(serve_dir: str, base_url: str) -> str:
    """The host's pip index, extra indexes and find-links, with every local directory (file:// or
    a path) linked under `serve_dir` and named by its URL under `base_url` (a server on 127.0.0.1
    that builds reach through host networking). Remote URLs pass through unchanged."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():  # `global.find-links='/opt/wheels'`, `:env:.timeout='180'`
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("index-url", "extra-index-url", "find-links", "default-timeout", "timeout") and value:
            conf.setdefault(name, value.strip("'\""))
    os.makedirs(serve_dir, exist_ok=True)

    def served(src: str, index: bool) -> str:
        path = os.path.abspath(src.removeprefix("file://"))
        if "://" in src and not src.startswith("file://"):
            return src
        # An index's pages may link files beside it (../../files/x.whl): serve its parent.
        root, tail = (os.path.dirname(path), os.path.basename(path) + "/") if index else (path, "")
        link = f"d{len(os.listdir(serve_dir))}"
        os.symlink(root, os.path.join(serve_dir, link))
        return f"{base_url.rstrip('/')}/{link}/{tail}"

    lines = ["[global]", f"constraint = {IMAGE_CONSTRAINTS}"]
    for name in ("index-url", "extra-index-url", "find-links"):
        if name in conf:
            urls = " ".join(served(s, name != "find-links") for s in conf[name].split())
            lines.append(f"{name} = {urls}")
    timeout = conf.get("timeout") or conf.get("default-timeout")
    if timeout:
        lines.append(f"timeout = {timeout}")
    return "\n".join(lines) + "\n"


def render(config: dict) -> dict:
    """`docker-compose -f docker-compose.yml -f compose.ci.yml config`, as a file compose v1 can
    run: the `ports:` of host-network services removed (Docker discards them on the host network,
    but compose v1's client refuses the pair, and an override cannot delete a key), and every `$`
    doubled so that compose reads back exactly the values `config` printed."""

    def esc(v):
        if isinstance(v, str):
            return v.replace("$", "$$")
        if isinstance(v, list):
            return [esc(x) for x in v]
        if isinstance(v, dict):
            return {k: esc(x) for k, x in v.items()}
        return v

    out = esc(config)
    for svc in out["services"].values():
        if svc.get("network_mode") == "host":
            svc.pop("ports", None)
    return out


def _conn():
    import redis

    return redis.Redis.from_url(os.environ["HARVEST_REDIS_URL"])


def workers(containers: dict[str, int]) -> list[dict]:
    """Which RQ worker runs in which container, and its current job. All containers share the
    host's network, so a container's Redis connections are told apart by their local ports: `ss`
    names the process (the container's PID 1 on the host, or its child under tini) behind each, and RQ names its
    connection after the worker (CLIENT SETNAME)."""
    from rq import Worker

    ss = subprocess.run(["ss", "-Htnp", "state", "established"], capture_output=True, text=True).stdout
    port_pid = {}
    for line in ss.splitlines():
        m = re.search(r"127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:16379\s.*pid=(\d+),", line)
        if m:
            port_pid[m.group(1)] = int(m.group(2))
    conn = _conn()
    pid_name = {}
    for c in conn.client_list():
        port = c["addr"].rsplit(":", 1)[-1]
        if c.get("name") and port in port_pid:
            pid_name[port_pid[port]] = c["name"]
    by_name = {w.name: w for w in Worker.all(connection=conn)}
    out = []
    for container, pid in containers.items():
        # PID 1 of the container is tini (`init: true`); the worker is its child.
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pids = [pid, *map(int, f.read().split())]
        except OSError:
            pids = [pid]
        name = next((pid_name[p] for p in pids if p in pid_name), None)
        w = by_name.get(name) if name else None
        out.append(
            {
                "container": container,
                "worker": name,
                "state": w.get_state() if w else None,
                "job": w.get_current_job_id() if w else None,
            }
        )
    return out


def job(job_id: str) -> dict:
    from rq.exceptions import NoSuchJobError

    from harvest.state.jobs import fetch_job

    try:
        j = fetch_job(_conn(), job_id)
    except NoSuchJobError:
        return {"job": job_id, "status": "gone"}  # finished: harvest keeps no RQ results (RESULT_TTL 0)
    return {"job": job_id, "status": str(j.get_status(refresh=True)), "worker": j.worker_name}


def reaped(job_id: str) -> int:
    from harvest.state.keys import Keys

    return int(_conn().hget(Keys(os.environ["CI_RUN"]).reaped, job_id) or 0)


def counts() -> dict:
    from harvest.state.ledger import Ledger

    ledger = Ledger(_conn(), os.environ["CI_RUN"])
    return {**ledger.counts(), "stats": ledger.stats()}


def verify(model: str, dataset: str, out_url: str) -> dict:
    """The accounting, from the object store: copies counted from the index files themselves (a
    reader would refuse a sample in two shards), tokens and mask read back through RunReader and
    compared with the tokenizer's own encoding of each row (tests.support.expected)."""
    import numpy as np
    from transformers import AutoTokenizer

    from harvest.ids import sample_id
    from harvest.read.reader import RunReader
    from harvest.state.ledger import Ledger
    from harvest.storage import Location
    from tests.support.expected import expected_tokens

    tok = AutoTokenizer.from_pretrained(model)
    expected = {}
    with open(dataset) as f:
        for line in f:
            ids, mask = expected_tokens(tok, json.loads(line))
            expected[sample_id(np.array(ids, np.int32), np.array(mask, np.uint8))] = (list(ids), list(mask))
    loc = Location.from_url(out_url)
    copies: Counter = Counter()
    for name in loc.list("index", ".json"):
        copies.update(loc.read_json(f"index/{name}")["samples"])
    failures = Ledger(_conn(), os.environ["CI_RUN"]).failures()
    wrong = []
    if all(n == 1 for n in copies.values()):
        reader = RunReader(out_url)
        for sid in copies:
            s = reader.get(sid)
            if (s["input_ids"].tolist(), s["loss_mask"].tolist()) != expected.get(sid, (None, None)):
                wrong.append(sid)
    rep = {
        "rows": sum(1 for _ in open(dataset)),
        "samples": len(expected),
        "done": sum(1 for sid in expected if copies[sid]),
        "doubled": sum(1 for sid in expected if copies[sid] > 1) + sum(1 for sid in copies if sid not in expected),
        "lost": sum(1 for sid in expected if not copies[sid] and sid not in failures),
        "failed": sum(1 for sid in expected if sid in failures and not copies[sid]),
        "wrong_tokens": len(wrong),
        "shards": len(loc.list("index", ".json")),
        "tokens": sum(len(expected[sid][0]) for sid in expected if copies[sid]),
    }
    rep["ok"] = rep["done"] == rep["samples"] and not (rep["doubled"] or rep["lost"] or rep["failed"] or wrong)
    return rep


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="compose_ci.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("pip-conf")
    pc.add_argument("serve_dir")
    pc.add_argument("base_url")
    pc.add_argument("constraints")
    sub.add_parser("render")
    sub.add_parser("workers").add_argument("containers", nargs="*", help="NAME=PID")
    sub.add_parser("job").add_argument("job_id")
    sub.add_parser("counts")
    sub.add_parser("reaped").add_argument("job_id")
    v = sub.add_parser("verify")
    for arg in ("model", "dataset", "out_url"):
        v.add_argument(arg)
    a = p.parse_args(argv)
    if a.cmd == "render":
        import yaml

        yaml.safe_dump(render(yaml.safe_load(sys.stdin)), sys.stdout, sort_keys=False)
    elif a.cmd == "workers":
        print(json.dumps(workers({c.split("=")[0]: int(c.split("=")[1]) for c in a.containers})))
    elif a.cmd == "job":
        print(json.dumps(job(a.job_id)))
    elif a.cmd == "reaped":
        print(reaped(a.job_id))
    elif a.cmd == "counts":
        print(json.dumps(counts()))
    elif a.cmd == "verify":
        rep = verify(a.model, a.dataset, a.out_url)
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    elif a.cmd == "pip-conf":
        sys.stdout.write(pip_conf(a.serve_dir, a.base_url))
        with open(a.constraints, "w") as f:
            f.write(host_constraints())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
