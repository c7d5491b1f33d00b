"""Where a run's configuration lives: Redis for the nodes, `<out>/<run>/run.json` for readers.

Publishing is idempotent and strict: the first start of a run writes both; a later start
with an identical configuration changes nothing (run.json is not rewritten), and one that
differs in anything that changes what is stored is refused before a single sample moves.
"""

from __future__ import annotations

import redis

from harvest.config import ConfigError, RunConfig
from harvest.state.keys import Keys
from harvest.storage import Location

RUN_FILE = "run.json"


def run_location(out_url: str, run: str) -> Location:
    return Location.from_url(out_url).child(run)


def _check_same(a: RunConfig, b: RunConfig, where: str) -> None:
    ia, ib = a.identity(), b.identity()
    diff = sorted(k for k in ia if ia[k] != ib[k])
    if diff:
        details = ", ".join(f"{k}: {ib[k]!r} there, {ia[k]!r} now" for k in diff)
        raise ConfigError(f"run {a.run!r} already exists with a different configuration in {where} ({details}); use another --run name")


def publish_run(conn: redis.Redis, cfg: RunConfig) -> RunConfig:
    """Store the run in Redis and storage; returns the configuration now in force."""
    key = Keys(cfg.run).config
    loc = run_location(cfg.out_url, cfg.run)
    if loc.exists(RUN_FILE):
        _check_same(cfg, RunConfig.from_json(loc.read_bytes(RUN_FILE)), loc.path(RUN_FILE))
    else:
        loc.write_atomic(RUN_FILE, cfg.to_json().encode())
    if not conn.set(key, cfg.to_json(), nx=True):
        stored = RunConfig.from_json(conn.get(key))
        _check_same(cfg, stored, f"Redis key {key}")
        return stored
    return cfg


def load_run(conn: redis.Redis, run: str) -> RunConfig:
    raw = conn.get(Keys(run).config)
    if raw is None:
        raise ConfigError(f"run {run!r} is not in Redis: start it with `harvest run` or `harvest produce` first")
    return RunConfig.from_json(raw)


def read_run_json(loc: Location) -> RunConfig:
    try:
        return RunConfig.from_json(loc.read_bytes(RUN_FILE))
    except FileNotFoundError:
        raise ConfigError(f"{loc.path(RUN_FILE)} not found: not a harvest run output") from None
