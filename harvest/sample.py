"""A sample: one tokenized sequence to extract, named by a hash of its content.

`Sample` is what every wing hands to the next: the producer builds it from a dataset row, a job
carries it as its row (harvest.state.payload), a worker extracts it and the collector packs it.
Its id is derived from its tokens, loss mask and conversation, never given: two rows of one content
are one sample, and a row changed in Redis no longer matches its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from harvest.errors import InputError
from harvest.ids import sample_id
from harvest.state.conversation import Conversation, ConversationError

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


class SampleError(InputError, ValueError):
    """Tokens, a loss mask or a conversation that do not make a sample."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    # A conversation to regenerate (harvest.state.conversation): `input_ids` is then its skeleton,
    # the tokens around the assistant turns, and `loss_mask` all zeros, until a worker generates
    # the turns; the regenerated sample keeps this id.
    conv: Conversation | None = None

    @classmethod
    def build(
        cls, input_ids: ArrayLike, loss_mask: ArrayLike | None = None, conv: Conversation | None = None
    ) -> Sample:
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise SampleError(f"input_ids must be a flat list, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise SampleError("input_ids out of int32 range")
        ids = ids.astype(np.int32)
        mask = np.ones(len(ids), np.uint8) if loss_mask is None else np.asarray(loss_mask).astype(np.uint8)
        if mask.shape != ids.shape:
            raise SampleError(f"loss_mask has {mask.size} entries for {ids.size} tokens")
        if mask.size and mask.max() > 1:
            raise SampleError("loss_mask must hold only 0 and 1")
        if conv is not None:
            try:
                conv.pieces(ids)
            except ConversationError as e:
                raise SampleError(str(e)) from None
            if mask.any():
                raise SampleError("a conversation to regenerate has no loss mask yet: its turns are not written")
        return cls(sample_id(ids, mask, conv.digest() if conv is not None else b""), ids, mask, conv)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    def regenerated(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> Sample:
        """The sample a worker extracts once this conversation's turns are generated: its tokens,
        under this conversation's id (the ledger's, the seeds')."""
        if self.conv is None:
            raise SampleError(f"sample {self.id} is no conversation to regenerate")
        return Sample(self.id, np.asarray(input_ids, np.int32), np.asarray(loss_mask, np.uint8))


def split_jobs(samples: list[Sample], max_samples: int, max_tokens: int) -> list[list[Sample]]:
    """Cut samples, in order, into jobs bounded by count and tokens; a sample
    longer than `max_tokens` goes alone."""
    jobs: list[list[Sample]] = []
    cur: list[Sample] = []
    tokens = 0
    for s in samples:
        if cur and (len(cur) >= max_samples or tokens + s.num_tokens > max_tokens):
            jobs.append(cur)
            cur, tokens = [], 0
        cur.append(s)
        tokens += s.num_tokens
    if cur:
        jobs.append(cur)
    return jobs
