"""Small committed runs for the training feed's tests: shards of chosen, uneven sizes packed by
the real shard writer and committed by their index files, as the collector does (no Redis)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from harvest.config import RunConfig
from harvest.formats.index import encode_index, index_file
from harvest.formats.runfile import RUN_FILE
from harvest.formats.shard import encode_shard, plan_shard, shard_file
from harvest.formats.shard_write import write_shard
from harvest.formats.spool import SpooledSample, inspect_sample
from harvest.node.spooldir import spool_path
from harvest.storage import Location
from tests.support.synth import HIDDEN, POINTS, make_config, spool_samples


class FeedRun:
    """A run at `<tmp>/out/r` whose samples are spooled once and committed in shards on demand."""

    def __init__(
        self,
        tmp_path,
        n: int,
        dtype: str = "bf16",
        hidden: int = HIDDEN,
        tokens: int | None = None,
        out_url: str | None = None,
        codec: str = "none",
    ) -> None:
        """`n` samples of 1..11 tokens (or `tokens` each), hidden size `hidden`, committed into
        `out_url` (default: the folder `<tmp_path>/out`), their hidden states coded by `codec`."""
        self.cfg: RunConfig = make_config(out_url or str(tmp_path / "out"), dtype=dtype, hidden=hidden, codec=codec)
        self.loc = Location.from_url(self.cfg.out_url).child(self.cfg.run)
        self.loc.write_atomic(RUN_FILE, self.cfg.to_json().encode())
        self.spool = str(tmp_path / "spool")
        lengths = [tokens or 1 + (7 * i) % 11 for i in range(n)]
        self.samples: list[SpooledSample] = spool_samples(self.spool, self.cfg, lengths)
        self.by_tokens = {tuple(s.input_ids.tolist()): s.id for s in self.samples}
        self.url = self.loc.root if self.loc.is_local else self.loc.url()

    def commit(self, indices: Sequence[int]) -> str:
        """One shard of these samples, then its index (the commit); returns the shard id."""
        entries = [
            inspect_sample(
                spool_path(self.spool, self.samples[i].id),
                self.samples[i].id,
                len(POINTS),
                self.cfg.hidden_size,
                self.cfg.torch_dtype,
            )
            for i in indices
        ]
        plan = plan_shard(entries, self.cfg.run, self.cfg.capture_points, self.cfg.torch_dtype, codec=self.cfg.codec)
        if plan.needs_encoding:
            plan = encode_shard(plan, os.path.join(self.spool, f".coded-{plan.shard_id}"))
        buf = io.BytesIO()
        sums = write_shard(plan, buf)
        self.loc.write_atomic(shard_file(plan.shard_id), buf.getvalue())
        self.loc.write_atomic(index_file(plan.shard_id), encode_index(plan.index(sums)))
        return plan.shard_id

    def commit_sizes(self, sizes: Sequence[int], start: int = 0) -> list[str]:
        """Consecutive samples from `start` in shards of `sizes` samples each."""
        out, at = [], start
        for n in sizes:
            out.append(self.commit(range(at, at + n)))
            at += n
        return out

    def sid(self, item: dict) -> str:
        """The sample an item of the feed is (its token ids are unique in these runs)."""
        return self.by_tokens[tuple(item["input_ids"].tolist())]

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.samples]
