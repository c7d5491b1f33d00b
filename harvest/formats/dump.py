"""The dump file: one prefill chunk of one request, from an engine to the workers.

For every prefill chunk of a request whose rid starts with `hv-`, the engine writes
`<dump_dir>/<rid>.<start>-<end>.safetensors` holding `hidden_states` `[end-start, K, H]`
(engine dtype) and `input_ids` `[end-start]`, with the capture points, the model name and the
crc32 of each tensor's bytes (harvest.formats.crc) in the metadata; a reader checks the sums
before it accepts a value, so bytes changed between the engine and the worker are refused.
Engines cut their flat forward batch into chunks with `harvest.engines.batch.cut_batch` and write them
through `harvest.engines.dump_writer.DumpWriter`, which calls `write_chunk` here; the vLLM client writes
the same files from vLLM's. Where the files live and what else the dump
directory holds is `harvest.node.dumpdir`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harvest.atomic import write_atomic
from harvest.errors import InputError
from harvest.ids import parse_rid
from harvest.node.dumpdir import temp_chunk_path
from harvest.node.paths import check_regular_file

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported where a chunk's tensors are, not at import: the janitor
# (and with it `harvest status`, `requeue`, `janitor`) needs only the chunk file names.

FORMAT = "harvest-dump-1"
_NAME = re.compile(r"(hv-[0-9a-f]{32}-[0-9]+)\.([0-9]+)-([0-9]+)\.safetensors")


class DumpError(InputError, ValueError):
    """A dump file that does not follow the contract."""


def chunk_name(rid: str, start: int, end: int) -> str:
    parse_rid(rid)
    return f"{rid}.{start}-{end}.safetensors"


def parse_chunk_name(name: str) -> tuple[str, int, int] | None:
    """(rid, start, end) of a chunk file name, or None for anything else in the directory."""
    m = _NAME.fullmatch(name)
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3))


@dataclass
class Chunk:
    """Rows of one request in one forward: prompt positions [start, end)."""

    rid: str
    start: int
    end: int
    input_ids: torch.Tensor  # [end-start]
    hidden_states: torch.Tensor  # [end-start, K, H]


def encode_chunk(chunk: Chunk, capture_points: Sequence[int], model: str) -> bytes:
    import torch

    from harvest.formats.crc import FIELD, encode_sums, tensor_crc32
    from harvest.formats.stformat import BLOCK, encode

    tensors = {
        "hidden_states": chunk.hidden_states.detach().to("cpu").contiguous(),
        "input_ids": chunk.input_ids.detach().to("cpu", torch.int64).contiguous(),
    }
    meta = {
        "format": FORMAT,
        "rid": chunk.rid,
        "start": str(chunk.start),
        "end": str(chunk.end),
        "capture_points": json.dumps(list(capture_points)),
        "model": model,
        FIELD: encode_sums({name: tensor_crc32(t) for name, t in tensors.items()}),
    }
    # hidden_states (the first tensor by name) starts on a filesystem block, so a worker can have the
    # kernel clone it into the spool instead of copying it (harvest.formats.filecopy)
    return encode(tensors, meta, BLOCK)


def write_chunk(dump_dir: str, chunk: Chunk, capture_points: Sequence[int], model: str) -> str:
    """Write one chunk file atomically (temporary dot-name, then rename: harvest.atomic), so a
    worker that lists the directory sees either nothing or the whole file. No fsync: the dump
    dir is tmpfs by default and a file lives only until a worker claims it; a full disk keeps no
    partial file."""
    name = chunk_name(chunk.rid, chunk.start, chunk.end)
    path = os.path.join(dump_dir, name)
    data = encode_chunk(chunk, capture_points, model)
    write_atomic(path, data, temp=temp_chunk_path(dump_dir, name), fsync=False)
    return path


@dataclass
class ChunkFile:
    rid: str
    start: int
    end: int
    capture_points: list[int]
    model: str
    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    path: str
    hidden_span: tuple[int, int]  # where hidden_states' bytes lie in `path`: [begin, end)
    hidden_crc32: int  # the crc32 of hidden_states' bytes, recorded by the engine and checked


def read_chunk(path: str) -> ChunkFile:
    """Read and check one chunk file against its own name and the crc32s its writer recorded;
    any mismatch is a DumpError."""
    from safetensors import safe_open

    from harvest.formats.crc import check_sums
    from harvest.formats.stformat import read_file_header

    parsed = parse_chunk_name(os.path.basename(path).removesuffix(".claimed"))
    try:
        check_regular_file(path)
    except OSError as e:
        raise DumpError(f"{path}: {e}") from None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != {"hidden_states", "input_ids"}:
                raise DumpError(f"{path}: tensors {sorted(names)}, expected hidden_states and input_ids")
            hs = f.get_tensor("hidden_states")
            ids = f.get_tensor("input_ids")
        span = read_file_header(path)[0]["hidden_states"]
    except DumpError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise DumpError(f"{path}: unreadable dump file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise DumpError(f"{path}: format {meta.get('format')!r}, expected {FORMAT}")
    try:
        rid, start, end = meta["rid"], int(meta["start"]), int(meta["end"])
        cps = [int(x) for x in json.loads(meta["capture_points"])]
    except (KeyError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: bad metadata ({e})") from None
    if parsed is not None and parsed != (rid, start, end):
        raise DumpError(f"{path}: file name says {parsed}, metadata says {(rid, start, end)}")
    n = end - start
    if hs.ndim != 3 or hs.shape[0] != n or ids.shape != (n,):
        raise DumpError(
            f"{path}: shapes hidden_states {tuple(hs.shape)} input_ids {tuple(ids.shape)} for {n} positions"
        )
    if hs.shape[1] != len(cps):
        raise DumpError(f"{path}: {hs.shape[1]} capture slots for capture points {cps}")
    if span.end - span.begin != hs.numel() * hs.element_size():
        raise DumpError(f"{path}: hidden_states spans {span.end - span.begin} bytes for {list(hs.shape)} {hs.dtype}")
    try:
        sums = check_sums(meta, {"hidden_states": hs, "input_ids": ids}, "the engine")
    except ValueError as e:
        raise DumpError(f"{path}: {e}") from None
    return ChunkFile(
        rid, start, end, cps, meta.get("model", ""), ids, hs, path, (span.begin, span.end), sums["hidden_states"]
    )
