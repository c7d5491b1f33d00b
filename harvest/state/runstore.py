"""The run in Redis, for the nodes; its storage half, `<out>/<run>/run.json` for readers, is
harvest.formats.runfile.

Publishing is idempotent and strict: the first start of a run writes both; a later start
with an identical configuration changes nothing (run.json is not rewritten), and one that
differs in anything that changes what is stored is refused before a single sample moves.
"""

from __future__ import annotations

from dataclasses import replace

import redis

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.formats.runfile import check_run_json, check_same_run, publish_run_json
from harvest.state.keys import Keys


def check_run(conn: redis.Redis | None, cfg: RunConfig) -> None:
    """Refuse `cfg` (ConfigurationError) if Redis (when given) or the output already holds the run with a
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
    from the stored run leaves no run.json in a new output behind. The stored run comes back with
    `cfg`'s model path: the checkpoint checked (by its fingerprint) is the one this start uses,
    wherever the first start found it."""
    key = Keys(cfg.run).config
    check_run(conn, cfg)
    publish_run_json(cfg)
    if not conn.set(key, cfg.to_json(), nx=True):
        stored = RunConfig.from_json(conn.get(key))
        check_same_run(cfg, stored, f"Redis key {key}")
        return replace(stored, model=cfg.model)
    return cfg


def load_run(conn: redis.Redis, run: str) -> RunConfig:
    raw = conn.get(Keys(run).config)
    if raw is None:
        raise ConfigurationError(f"run {run!r} is not in Redis: start it with `harvest run` or `harvest produce` first")
    return RunConfig.from_json(raw)


def accept_model(
    conn: redis.Redis, run: str, model_dir: str, out_url: str | None = None
) -> tuple[RunConfig, RunConfig]:
    """Record the checkpoint in `model_dir` as the run's model: run.json and Redis's copy (when it
    holds the run) get its fingerprint and path; (before, after). For a model saved again (copied,
    converted, re-sharded) whose fingerprint changed while it computes the same states: the
    operator vouches for that, this checks only that its shape is the run's. Run with the run
    stopped: a running worker keeps the configuration it read at its start."""
    from harvest.config import absolute_model, build_config
    from harvest.formats.fingerprint import differing
    from harvest.formats.runfile import RUN_FILE, read_run_json, run_location

    key = Keys(run).config
    raw = conn.get(key)
    base = out_url or (RunConfig.from_json(raw).out_url if raw is not None else None)
    if base is None:
        raise ConfigurationError(f"run {run!r} is not in Redis: pass --out URL, the output whose run.json it is")
    loc = run_location(base, run)
    old = read_run_json(loc)
    shaped = build_config(run, model_dir, old.out_url, layers=",".join(map(str, old.capture_points)))
    if shaped.hidden_size != old.hidden_size or old.num_layers not in (0, shaped.num_layers):
        raise ConfigurationError(
            f"{model_dir} has {shaped.num_layers} layers of width {shaped.hidden_size}, run {run!r} was "
            f"extracted from {old.num_layers} of width {old.hidden_size}: not its model"
        )
    if shaped.model_fingerprint is None:
        raise ConfigurationError(f"{model_dir}: no checkpoint there to fingerprint (config, tokenizer, weights)")
    if not differing(old.model_fingerprint, shaped.model_fingerprint) and old.model_fingerprint is not None:
        return old, old
    new = replace(old, model=absolute_model(model_dir), model_fingerprint=shaped.model_fingerprint)
    loc.write_atomic(RUN_FILE, new.to_json().encode())
    if raw is not None:
        conn.set(key, new.to_json())
    return old, new
