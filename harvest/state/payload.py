"""The job payload: a batch of tokenized samples as JSON.

Token ids travel as base64 of int32 LE (about 5.3 bytes a token instead of ~6-7 for a JSON
number list) and the loss mask as base64 of its bytes. Decoding re-derives every sample id
from its content, so a payload tampered with in Redis cannot point a worker at another
sample's files.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from harvest.ids import check_id, sample_id

PAYLOAD_VERSION = 1


class PayloadError(ValueError):
    """A job payload that is not what a producer writes."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    @classmethod
    def build(cls, input_ids, loss_mask=None) -> Sample:
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise PayloadError(f"input_ids must be a flat list, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise PayloadError("input_ids out of int32 range")
        ids = ids.astype(np.int32)
        mask = np.ones(len(ids), np.uint8) if loss_mask is None else np.asarray(loss_mask).astype(np.uint8)
        if mask.shape != ids.shape:
            raise PayloadError(f"loss_mask has {mask.size} entries for {ids.size} tokens")
        if mask.size and mask.max() > 1:
            raise PayloadError("loss_mask must hold only 0 and 1")
        return cls(sample_id(ids, mask), ids, mask)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)


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


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(a.tobytes()).decode("ascii")


def encode_batch(run: str, samples: list[Sample]) -> dict:
    return {
        "v": PAYLOAD_VERSION,
        "run": run,
        "samples": [
            {"id": s.id, "ids": _b64(s.input_ids.astype("<i4")), "mask": _b64(s.loss_mask)} for s in samples
        ],
    }


def decode_batch(payload: object) -> tuple[str, list[Sample]]:
    if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
        raise PayloadError(f"not a harvest v{PAYLOAD_VERSION} job payload")
    run = check_id(payload.get("run", ""), "run name")
    rows = payload.get("samples")
    if not isinstance(rows, list) or not rows:
        raise PayloadError("payload has no samples")
    out = []
    for row in rows:
        try:
            ids = np.frombuffer(base64.b64decode(row["ids"], validate=True), dtype="<i4").astype(np.int32)
            mask = np.frombuffer(base64.b64decode(row["mask"], validate=True), dtype=np.uint8)
            sid = check_id(row["id"], "sample id")
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"malformed sample in payload: {e}") from None
        s = Sample.build(ids, mask)
        if s.id != sid:
            raise PayloadError(f"sample {sid} does not match its content (hash {s.id})")
        out.append(s)
    return run, out


def payload_row(run: str, sample: Sample) -> str:
    """One sample's payload row (the encoding of a job's samples), kept in Redis while the sample
    is spooled or failed so its job can be built again without the dataset."""
    return json.dumps(encode_batch(run, [sample])["samples"][0])


def payload_rows(payload: dict) -> list[str]:
    """The rows of a payload that `decode_batch` accepted, in its order, as `payload_row` writes
    them: the job's own base64 strings, not encoded again."""
    return [json.dumps({"id": r["id"], "ids": r["ids"], "mask": r["mask"]}) for r in payload["samples"]]
