"""Reading a finished (or growing) run's output: the public API a trainer uses.

`from harvest.read import RunReader, HiddenStateIterable, export_run, CorruptSample, ...`: the
names in `__all__` are what this package promises; they are loaded on first use (PEP 562), so
`import harvest.read` costs nothing and torch comes with the first name that needs it. Reading
needs only the output folder (any fsspec URL): the run's configuration comes from its run.json
(harvest.formats.runfile), so nothing here imports Redis or RQ.

- reading: `RunReader` (samples by id, shard by shard, each checked against its crc32) and
  `hidden_at` (one capture point of a sample);
- training: `HiddenStateDataset` (map-style) and `HiddenStateIterable` (the training feed: equal
  spans of a seeded, shard-local order for every rank and DataLoader worker, read-ahead,
  `state_dict`/`load_state_dict`, following a live run), whose items `eagle3_item` shapes;
- trainers' own files: `export_run` into one of `EXPORT_FORMATS`, with its `ExportReport`;
- what a read raises: `ConfigError` (no run, or a run.json this harvest cannot read),
  `ShardError` (a shard or index that disagrees with its run; the base of the next two),
  `CorruptSample` (one sample's bytes fail their check), `UnreadableShard` (a whole shard lost),
  `NoFinalState` (a dataset over a run without the final state), `ExportError` (an export its
  trainer cannot use), `FeedStalled` (a followed run committed nothing new for the feed's wait and
  is not settled).

The modules below (reader, shard_reader, dataset, partition, readahead, follow, export, specforge,
speculators, final_norm, trainers) hold the implementation; their other names are harvest's own, not promised to trainers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers; loaded lazily below
    from harvest.config import ConfigError
    from harvest.formats.index import ShardError
    from harvest.read.damage import CorruptSample, UnreadableShard
    from harvest.read.dataset import HiddenStateDataset
    from harvest.read.eagle3 import NoFinalState, eagle3_item
    from harvest.read.export import ExportReport, export_run
    from harvest.read.feed import HiddenStateIterable
    from harvest.read.follow import FeedStalled
    from harvest.read.reader import RunReader, hidden_at
    from harvest.read.trainers import EXPORT_FORMATS, ExportError

__all__ = [
    "RunReader",
    "hidden_at",
    "HiddenStateDataset",
    "HiddenStateIterable",
    "eagle3_item",
    "export_run",
    "ExportReport",
    "EXPORT_FORMATS",
    "ConfigError",
    "ShardError",
    "CorruptSample",
    "UnreadableShard",
    "NoFinalState",
    "ExportError",
    "FeedStalled",
]

# Each public name -> the module that defines it.
_HOME = {
    "RunReader": "harvest.read.reader",
    "hidden_at": "harvest.read.reader",
    "HiddenStateDataset": "harvest.read.dataset",
    "HiddenStateIterable": "harvest.read.feed",
    "eagle3_item": "harvest.read.eagle3",
    "NoFinalState": "harvest.read.eagle3",
    "export_run": "harvest.read.export",
    "ExportReport": "harvest.read.export",
    "ExportError": "harvest.read.trainers",
    "EXPORT_FORMATS": "harvest.read.trainers",
    "ConfigError": "harvest.config",
    "ShardError": "harvest.formats.index",
    "CorruptSample": "harvest.read.damage",
    "UnreadableShard": "harvest.read.damage",
    "FeedStalled": "harvest.read.follow",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
