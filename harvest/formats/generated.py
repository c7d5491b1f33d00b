"""The generated dataset: the conversations a `--regenerate` run's target model wrote.

`<out>/<run>/generated/<shard_id>.parquet` holds one row per regenerated sample of shard
`<shard_id>`, in the shard's storage order, and the shard's index names it with its sha256
(`ShardIndex.generated`). So it is committed by the very document that commits the hidden states:
the collector writes it after the shard's bytes and before the commit fence (collector.publish),
and a conversation whose shard is never indexed is in no committed file. Readers go through the
index (harvest.read.generated), which also skips the samples an index excludes; a file no index
names is a given-up shard's, removed with it.

Parquet (zstd) so that a person can load it with pandas, pyarrow or `datasets` and train on the
text, or reuse it as a dataset: per row the sample id, the messages as generated (the rows'
system and user turns, the assistant turns' text as the engine decoded it), and per turn its
tokens exactly as generated (the stop token last when it stopped), its finish reason ("stop" or
"length"), its sampling seed and its prompt length.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from typing import Any

from harvest.formats.index import ShardError
from harvest.ids import check_id
from harvest.storage import Location

GENERATED = "generated"


def generated_file(shard_id: str) -> str:
    return posixpath.join(GENERATED, f"{check_id(shard_id, 'shard id')}.parquet")


def _schema() -> Any:
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    turn = pa.struct(
        [
            ("tokens", pa.list_(pa.int32())),
            ("finish_reason", pa.string()),
            ("seed", pa.int64()),
            ("prompt_tokens", pa.int32()),
        ]
    )
    return pa.schema([("id", pa.string()), ("messages", pa.list_(message)), ("turns", pa.list_(turn))])


def _text(v: object) -> str | None:
    """A message's content as text: a string as it is, structured content (parts lists) as its JSON."""
    return v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def encode_generated(records: list[dict[str, Any]]) -> bytes:
    """`records` (harvest.workers.regenerate's entries, in storage order) as one Parquet file's bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": r["id"],
            "messages": [{"role": m["role"], "content": _text(m.get("content"))} for m in r["messages"]],
            "turns": [{k: t[k] for k in ("tokens", "finish_reason", "seed", "prompt_tokens")} for t in r["turns"]],
        }
        for r in records
    ]
    table = pa.Table.from_pylist(rows, schema=_schema())
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def decode_generated(data: bytes, name: str, sha256: str | None = None) -> list[dict[str, Any]]:
    """The rows of generated file `name` (its bytes `data`), checked against the index's sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ShardError(f"generated file {name}: its sha256 is not the one its index recorded (corrupt or replaced)")
    try:
        # One file read on this thread: `pq.read_table` goes through Arrow's dataset scanner, whose
        # pool threads can still be alive as the interpreter exits, and Arrow then aborts the
        # process (apache/arrow#34314).
        rows: list[dict[str, Any]] = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False).to_pylist()
        return rows
    except Exception as e:  # noqa: BLE001 - pyarrow's many error types for a file that is not Parquet
        raise ShardError(f"generated file {name}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def entry(name: str, data: bytes, rows: int) -> dict[str, Any]:
    """The index's `generated` field for the file `name` holding `data`."""
    return {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "rows": rows}


def store_generated(loc: Location, shard_id: str, records: list[str]) -> dict[str, Any]:
    """Shard `shard_id`'s generated file written whole into the run folder `loc` from its samples'
    entries (JSON, as the spool files carry them, in storage order); returns its index entry. The
    same entries give the same bytes, so a retried commit rewrites the same file.

    Who may write it, and what fences a late one: the collector holding the shard's claims in
    storage (harvest.formats.claims), between the shard's upload and the commit fence, as for the
    shard object itself. A node that comes back late holds no claim on a sample another shard
    committed (it voids its own shard, and `remove_shard` deletes this file with it), and nothing
    reads the file until the index the fence decided names it, with its sha256. Redis forgetting
    its last second changes nothing here: the file, like the shard, is named by content and ledger
    id, and the claims and the index, both in storage, decide what is committed."""
    name = generated_file(shard_id)
    data = encode_generated([json.loads(r) for r in records])
    loc.write_atomic(name, data)
    return entry(name, data, len(records))
