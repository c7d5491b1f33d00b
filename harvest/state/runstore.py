"""The run in Redis, for the nodes; its storage half, `<out>/<run>/run.json` for readers, is
harvest.formats.runfile.

Publishing is idempotent and strict: the first start of a run writes both; a later start
with an identical configuration changes nothing (run.json is not rewritten), and one that
differs in anything that changes what is stored is refused before a single sample moves.
"""

from __future__ import annotations

import redis

from harvest.config import ConfigError, RunConfig
from harvest.formats.runfile import check_run_json, check_same_run, publish_run_json
from harvest.state.keys import Keys


def check_run(conn: redis.Redis | None, cfg: RunConfig) -> None:
    """Refuse `cfg` (ConfigError) if Redis (when given) or the output already holds the run with a
    configuration that stores something else; writes nothing, so a command can ask before it
    creates anything of its own (`harvest run`: its work dir, its private Redis)."""
    if conn is not None:
        key = Keys(cfg.run).config
        raw = conn.get(key)
        if raw is not None:
            check_same_run(cfg, RunConfig.from_json(raw), f"Redis key {key}")
    check_run_json(cfg)


def publish_run(conn: redis.Redis, cfg: RunConfig) -> RunConfig:
    """Store the run in Redis and storage; returns the configuration now in force. Redis's copy
    is checked before run.json is written: a start refused for a configuration that differs
    from the stored run leaves no run.json in a new output behind."""
    key = Keys(cfg.run).config
    check_run(conn, cfg)
    publish_run_json(cfg)
    if not conn.set(key, cfg.to_json(), nx=True):
        stored = RunConfig.from_json(conn.get(key))
        check_same_run(cfg, stored, f"Redis key {key}")
        return stored
    return cfg


def load_run(conn: redis.Redis, run: str) -> RunConfig:
    raw = conn.get(Keys(run).config)
    if raw is None:
        raise ConfigError(f"run {run!r} is not in Redis: start it with `harvest run` or `harvest produce` first")
    return RunConfig.from_json(raw)
