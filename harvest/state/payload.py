"""The job payload: a batch of tokenized samples as JSON.

Token ids travel as base64 of little-endian integers of the fewest bytes that hold the sample's
largest id (`w`: 2 below 65,536, 3 below 2^24, else 4); the loss mask travels as base64 of its
bits (packed, little bit order). Both are cheap to make and leave RQ's zlib little to do; the
same rows are what Redis keeps for spooled and failed samples (`payload_row`). Decoding
re-derives every sample id from its content, so a payload tampered with in Redis cannot point a
worker at another sample's files.

A producer's job carries no rows: it names them in storage (`rows`, harvest.formats.jobrows), and
`inline` reads them back; jobs built by harvest itself from kept rows (requeue, reclaim, the
stranded sweep) carry theirs (`samples`).

A row of a `--regenerate` run carries `conv` (harvest.state.conversation): its tokens are the
conversation's skeleton and its id hashes the conversation too, so the id checks that the row's
tokens are that skeleton.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from harvest.formats import jobrows
from harvest.ids import check_id
from harvest.sample import Sample, SampleError
from harvest.state.conversation import Conversation

PAYLOAD_VERSION = 2


class PayloadError(SampleError):
    """A job payload that is not what a producer writes."""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _encode_ids(ids: np.ndarray) -> tuple[int, str]:
    top = int(ids.max()) if ids.size else 0
    if top < 1 << 16:
        return 2, _b64(ids.astype("<u2").tobytes())
    if top < 1 << 24:
        return 3, _b64(ids.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes())
    return 4, _b64(ids.astype("<i4").tobytes())


def _decode_ids(width: object, text: str) -> np.ndarray:
    raw = base64.b64decode(text, validate=True)
    if width == 2:
        return np.frombuffer(raw, dtype="<u2").astype(np.int32)
    if width == 3:
        if len(raw) % 3:
            raise ValueError(f"{len(raw)} bytes of 3-byte token ids")
        four = np.zeros((len(raw) // 3, 4), np.uint8)
        four[:, :3] = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        return four.view("<u4").reshape(-1).astype(np.int32)
    if width == 4:
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)
    raise ValueError(f"token id width {width!r} is not 2, 3 or 4")


def _encode_row(s: Sample) -> dict:
    width, ids = _encode_ids(s.input_ids)
    row = {"id": s.id, "w": width, "ids": ids, "bits": _b64(np.packbits(s.loss_mask, bitorder="little").tobytes())}
    if s.conv is not None:
        row["conv"] = s.conv.to_json()
    return row


def _decode_row(row: dict) -> tuple[str, np.ndarray, np.ndarray]:
    """(id, ids, mask) of a row."""
    sid = check_id(row["id"], "sample id")
    ids = _decode_ids(row["w"], row["ids"])
    bits = np.frombuffer(base64.b64decode(row["bits"], validate=True), dtype=np.uint8)
    if bits.size != (ids.size + 7) // 8:
        raise ValueError(f"{bits.size} bytes of mask bits for {ids.size} tokens")
    return sid, ids, np.unpackbits(bits, count=ids.size, bitorder="little")


def encode_batch(run: str, samples: list[Sample]) -> dict:
    return {"v": PAYLOAD_VERSION, "run": run, "samples": [_encode_row(s) for s in samples]}


def encode_ref(run: str, ref: dict, ids: list[str]) -> dict:
    """A job whose rows are in storage (`ref`: harvest.formats.jobrows.RowsObject.ref), with its
    sample ids in order: what covers which sample is known from Redis alone (`batch_ids`)."""
    return {"v": PAYLOAD_VERSION, "run": run, "ids": list(ids), "rows": ref}


def batch_ids(payload: object) -> list[str]:
    """A payload's sample ids without reading storage (PayloadError: not a payload that has them)."""
    try:
        if "samples" in payload:
            return [str(r["id"]) for r in payload["samples"]]
        return [str(i) for i in payload["ids"]]
    except (KeyError, TypeError) as e:
        raise PayloadError(f"payload names no sample ids: {e!r}") from None


def inline(payload: object) -> object:
    """`payload` with its rows in it (`samples`), read from storage where the job names them; any
    other payload as it is. PayloadError: the rows are gone or changed; StorageError: the store
    failed (a job that meets it is handed back, not failed)."""
    if isinstance(payload, dict) and "rows" in payload and "samples" not in payload:
        try:
            rows = jobrows.read(payload["rows"])
        except jobrows.JobRowsError as e:
            raise PayloadError(str(e)) from None
        if "ids" in payload and [r.get("id") if isinstance(r, dict) else None for r in rows] != payload["ids"]:
            raise PayloadError(f"job rows {payload['rows'].get('url')} hold other samples than the job names")
        return {**{k: v for k, v in payload.items() if k != "rows"}, "samples": rows}
    return payload


def decode_batch(payload: object) -> tuple[str, list[Sample]]:
    """A payload's run and samples, its rows read from storage if the job names them there (`inline`)."""
    if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
        raise PayloadError(f"not a harvest v{PAYLOAD_VERSION} job payload")
    payload = inline(payload)
    run = check_id(payload.get("run", ""), "run name")
    rows = payload.get("samples")
    if not isinstance(rows, list) or not rows:
        raise PayloadError("payload has no samples")
    out = []
    for row in rows:
        try:
            sid, ids, mask = _decode_row(row)
            conv = Conversation.from_json(row["conv"]) if "conv" in row else None
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"malformed sample in payload: {e}") from None
        try:
            s = Sample.build(ids, mask, conv)
        except SampleError as e:
            raise PayloadError(str(e)) from None
        if s.id != sid:
            raise PayloadError(f"sample {sid} does not match its content (hash {s.id})")
        out.append(s)
    return run, out


def payload_row(run: str, sample: Sample) -> str:
    """One sample's payload row (the encoding of a job's samples), kept in Redis while the sample
    is spooled or failed so its job can be built again without the dataset."""
    return json.dumps(encode_batch(run, [sample])["samples"][0])


def payload_rows(payload: dict) -> list[str]:
    """The rows of an inline payload that `decode_batch` accepted, in its order, as `payload_row` writes
    them: the job's own base64 strings, not encoded again."""
    return [json.dumps({k: r[k] for k in _ROW_KEYS if k in r}) for r in payload["samples"]]


_ROW_KEYS = ("id", "w", "ids", "bits", "conv")
