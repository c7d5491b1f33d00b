"""What a run's codec saves: `harvest ratio`, from its run.json and index files alone.

The hidden states' raw size is what the run's dtype stores them in (tokens x capture points x
hidden size x bytes a value); their stored size is the coded bytes the index files record
(`coded_offsets`), or the raw size for a run without a codec. The shards' other tensors (token
ids, masks, offsets, fp8 scales) and headers are never coded, and count on both sides of the
shard ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

from harvest.formats.dtypes import storage_torch_dtype
from harvest.formats.runfile import read_run_json
from harvest.ops.dedupe import read_indexes
from harvest.storage import Location


@dataclass(frozen=True)
class Ratio:
    run: str
    codec: str
    dtype: str
    shards: int
    tokens: int
    hidden_raw: int  # bytes the hidden states take as they are
    hidden_stored: int  # bytes they take in the shards
    shard_bytes: int  # the shard files' bytes in all

    @property
    def hidden_ratio(self) -> float:
        return self.hidden_raw / self.hidden_stored if self.hidden_stored else 1.0

    @property
    def shard_ratio(self) -> float:
        raw = self.shard_bytes - self.hidden_stored + self.hidden_raw
        return raw / self.shard_bytes if self.shard_bytes else 1.0

    def line(self) -> str:
        if not self.shards:
            return f"run {self.run} (codec {self.codec}): no shard committed yet"
        return (
            f"run {self.run} (codec {self.codec}, {self.dtype}): {self.shards} shards, {self.tokens} tokens; "
            f"hidden states {self.hidden_raw / 1e6:.1f} MB raw, {self.hidden_stored / 1e6:.1f} MB stored: "
            f"{self.hidden_ratio:.2f}x; shards {self.shard_bytes / 1e6:.1f} MB: {self.shard_ratio:.2f}x smaller "
            "than without the codec"
        )


def run_ratio(loc: Location) -> Ratio:
    """The ratio a run's committed shards achieve (every shard with an index file, its excluded
    samples included: their bytes are stored)."""
    cfg = read_run_json(loc)
    width = storage_torch_dtype(cfg.storage_dtype).itemsize * len(cfg.capture_points) * cfg.hidden_size
    docs = read_indexes(loc)
    tokens = sum(d["offsets"][-1] for d in docs)
    stored = sum(d["coded_offsets"][-1] if "coded_offsets" in d else d["offsets"][-1] * width for d in docs)
    return Ratio(
        cfg.run, cfg.codec, cfg.storage_dtype, len(docs), tokens, tokens * width, stored, sum(d["bytes"] for d in docs)
    )
