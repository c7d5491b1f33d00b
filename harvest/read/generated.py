"""Reading a `--regenerate` run's generated dataset: the conversations its target model wrote.

Only what an index commits (harvest.formats.generated): each committed shard's generated file,
checked against the sha256 its index recorded, less the samples the index excludes, and each
sample once (the copy `kept_copies` chooses, as every reader of the run does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from harvest.errors import ConfigurationError
from harvest.formats.generated import decode_generated
from harvest.formats.index import INDEX, kept_copies, read_index
from harvest.formats.runfile import read_run_json
from harvest.storage import Location


class NotRegenerated(ConfigurationError):
    """A run that regenerates nothing: its run.json has no regenerate settings."""


def iter_generated(run_url: str) -> Iterator[dict[str, Any]]:
    """Every committed regenerated conversation of the run at `run_url` (`<out>/<run>`), shard by
    shard in shard id order, each in storage order: {"id", "messages", "turns"} (the Parquet row).
    A folder that holds no run (ConfigError) or a run without --regenerate (NotRegenerated) is
    refused by name before anything is read."""
    loc = Location.from_url(run_url)
    cfg = read_run_json(loc)
    if cfg.regenerate is None:
        raise NotRegenerated(
            f"run {cfg.run} in {loc.url()} was not started with --regenerate: the target model "
            "wrote none of its answers, so it has no generated conversations"
        )
    docs = [read_index(loc, name) for name in loc.list(INDEX, ".json")]
    return _rows(loc, docs)


def _rows(loc: Location, docs: list[Any]) -> Iterator[dict[str, Any]]:
    kept = kept_copies(docs).kept
    for doc in sorted(docs, key=lambda d: d["shard_id"]):
        gen = doc.get("generated")
        if gen is None:
            continue
        rows = decode_generated(loc.read_bytes(gen["file"]), loc.describe(gen["file"]), gen["sha256"])
        for row in rows:
            if kept.get(row["id"]) == doc["shard_id"]:
                yield row
