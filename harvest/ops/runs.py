"""Opening a run to produce into: the policy `harvest produce` follows.

A producer given a model and an output opens a new run (or checks that the stored one of the
same name matches) and rebuilds its done-set from storage before enqueueing, so a rerun after
a lost Redis skips what is committed. Without them it joins the stored run. Job sizes are the
producer's own choice, not part of the run.
"""

from __future__ import annotations

import dataclasses

import redis

from harvest.config import RunConfig, build_config
from harvest.ops.reconcile import reconcile
from harvest.settings import IdentityDefaults, RunTunables
from harvest.state.runstore import load_run, publish_run


def open_run(
    conn: redis.Redis,
    run: str,
    *,
    model: str | None,
    out_url: str | None,
    layers: str,
    storage_dtype: str,
    engine: str,
    codec: str = IdentityDefaults.codec,
    dry_run: bool = False,
    batch_samples: int | None = None,
    batch_tokens: int | None = None,
    spool_grace_s: float = RunTunables.spool_grace_s,
    regenerate: dict | None = None,
) -> RunConfig:
    """The run `run`: published from these settings when `model` and `out_url` are given (a
    dry run publishes nothing), else the stored one; with this producer's job sizes.
    `regenerate`: a --regenerate run's settings (harvest.regeneration.Regeneration's fields)."""
    if model and out_url and not dry_run:
        cfg = publish_run(
            conn,
            build_config(
                run,
                model,
                out_url,
                layers,
                storage_dtype,
                engine=engine,
                codec=codec,
                spool_grace_s=spool_grace_s,
                regenerate=regenerate,
            ),
        )
        reconcile(conn, cfg)
    else:
        cfg = load_run(conn, run)
    return dataclasses.replace(
        cfg,
        max_batch_samples=batch_samples or cfg.max_batch_samples,
        max_batch_tokens=batch_tokens or cfg.max_batch_tokens,
    )
