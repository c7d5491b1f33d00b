"""Cutting an engine's flat extend batch into per-request dump chunks.

Shared by every engine that dumps from a batched forward (the reference engine and the SGLang
plugin), so the CPU tests run the production code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harvest.formats.dump import Chunk, DumpError
from harvest.ids import RID_PREFIX, parse_rid


def cut_batch(
    rids: Sequence[str],
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
) -> list[Chunk]:
    """Slice a flat extend batch (requests' new tokens laid end to end, as SGLang lays them)
    into per-request chunks; requests without the `hv-` prefix (warmup, health checks,
    foreign traffic) are skipped. The chunk's positions come from the prefix length, so
    chunked prefill yields consecutive chunks of one prompt."""
    if not (len(rids) == len(prefix_lens) == len(seq_lens)):
        raise DumpError(
            f"batch layout mismatch: {len(rids)} rids, {len(prefix_lens)} prefix lens, {len(seq_lens)} seq lens"
        )
    total = int(sum(seq_lens))
    if input_ids.shape[0] != total or hidden_states.shape[0] != total:
        raise DumpError(
            f"batch has {total} extend tokens but input_ids {tuple(input_ids.shape)} and hidden_states {tuple(hidden_states.shape)}"
        )
    chunks, loc = [], 0
    for rid, pre, n in zip(rids, prefix_lens, seq_lens, strict=False):
        pre, n = int(pre), int(n)
        if isinstance(rid, str) and rid.startswith(RID_PREFIX) and n > 0:
            try:
                parse_rid(rid)
            except ValueError:
                rid = None
            if rid is not None:
                chunks.append(Chunk(rid, pre, pre + n, input_ids[loc : loc + n], hidden_states[loc : loc + n]))
        loc += n
    return chunks
