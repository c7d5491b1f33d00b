"""Reading one committed shard by byte ranges, from any fsspec store, every sample checked.

Opening a shard costs two ranged reads: the safetensors header (a third only if the header is
longer than the first guess), and the token ids, loss mask and offsets, which lie together at the
file's end and are small (a few bytes a token); fp8 scales are fetched whole once, when first
needed. Each sample's hidden states are one ranged read of exactly its rows, or, where the caller
says which samples it reads next (`samples`, `sample(ahead=...)`), one ranged read for each run
of them adjacent in storage (harvest.read.coalesce), sliced apart; a shard whose samples wanted
hold most of it is read whole, in the one read that opens it. A trainer on S3 never downloads a
shard it only samples from.

Every range handed out is checked against the per-sample crc32s its index records (taken at
pack time, harvest.formats.shard_write): a byte that rotted in storage, or was cut short, fails
that one sample with `CorruptSample`, naming the shard file, the sample, the tensor, the byte
range and the fix, and the reader stays usable for every other sample. An index without crc32s
is read unchecked.

With a codec (harvest.formats.codec), the same reads fetch a sample's coded hidden states (the
index's `coded_offsets`), decoded on the thread that asked (a feed's read-ahead threads) and
checked by the raw bytes' crc32: what fails to decode, or decodes to other bytes, is corrupt.
"""

from __future__ import annotations

import json
import math
import threading
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence

import torch

from harvest.formats.codec import NONE, CodecError, decode
from harvest.formats.dtypes import dtype_name
from harvest.formats.fp8 import dequantize, is_fp8
from harvest.formats.index import ShardError, ShardIndex
from harvest.formats.shard import shard_file
from harvest.formats.spool import SCALE
from harvest.formats.stformat import BLOCK, FormatError, TensorSpan, header_length, parse_header, tensor_from_bytes
from harvest.read.coalesce import GAP_BYTES, cap_for, read_whole, runs
from harvest.read.damage import CorruptSample, UnreadableShard, object_url, verify_fix
from harvest.read.held import Held, HeldRead
from harvest.storage import Location

_SMALL = ("input_ids", "loss_mask", "offsets")


class ShardReader:
    """Random access into one committed shard (`index`: its parsed index, harvest.formats.index).
    `want`: the samples (rows of the index) the opener is about to read: where they hold most of
    a shard of at most `cap` bytes (default: harvest.read.coalesce.cap_for the store), the file is
    read whole as it is opened (read_whole) and those samples come from that read. Safe to share
    between threads."""

    def __init__(self, loc: Location, index: ShardIndex, want: Iterable[int] = (), cap: int | None = None) -> None:
        self.cap = cap_for(loc.is_local, cap)
        self._lock = threading.Lock()
        self._blocks: dict[int, HeldRead] = {}  # sample -> the bytes read (or being read) ahead for it
        try:
            self._open(loc, index, set(want), self.cap)
        # what damaged header bytes raise as they are parsed (a flipped byte can break the JSON, a key
        # or a number); a missing file; ShardError for a header that parses but disagrees with the index
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            if isinstance(e, FileNotFoundError):
                why = f"the file {object_url(loc, shard_file(index['shard_id']))} is missing"
            else:
                why = str(e) if isinstance(e, ShardError) else f"its header is damaged: {type(e).__name__}: {e}"
            raise UnreadableShard(index["shard_id"], why, len(index["samples"]), verify_fix(loc, plural=True)) from None

    def _open(self, loc: Location, index: ShardIndex, want: set[int], cap: int) -> None:
        self.loc, self.index = loc, index
        self.name: str = shard_file(index["shard_id"])  # from the checked id, never a path read from storage
        if index.get("shard", self.name) != self.name:
            raise ShardError(f"index of shard {index['shard_id']} names {index['shard']!r}, expected {self.name}")
        self.url = object_url(loc, self.name)
        # The header is ~0.5 KiB plus the sample ids (35 bytes each), padded so the data starts on a
        # block (stformat.BLOCK): guess that, rounded up to a block, so one read usually does.
        guess = 1024 + 40 * len(index["samples"])
        tokens = index["offsets"]
        whole = read_whole(sum(tokens[p + 1] - tokens[p] for p in want), tokens[-1], index.get("bytes"), cap)
        head = loc.read_range(self.name, 0, max(-(-guess // BLOCK) * BLOCK, index["bytes"] if whole else 0))
        try:
            n = header_length(head, self.name)
            raw = head[8 : 8 + n] if len(head) >= 8 + n else loc.read_range(self.name, 8, 8 + n)
            self.tensors, self.metadata = parse_header(raw, self.name)
        except FormatError as e:
            raise ShardError(str(e)) from None
        if json.loads(self.metadata.get("sample_ids", "[]")) != index["samples"]:
            raise ShardError(f"{self.name}: sample ids differ from its index file")
        missing = {"hidden_states", *_SMALL} - set(self.tensors)
        if missing:
            raise ShardError(f"{self.name}: lacks tensors {sorted(missing)}")
        names = index.get("crc32_tensors", [])
        if not set(names) <= set(self.tensors) - {"offsets"}:
            raise ShardError(
                f"{self.name}: its index has crc32s of tensors {names}, the shard holds {sorted(self.tensors)}"
            )
        self._slot = {name: j for j, name in enumerate(names)}
        self._open_hidden(index)
        self._small: dict[str, bytes | bytearray] = {}
        self._read_small(head)
        offsets = self._whole("offsets")  # the last tensor: a shard cut short anywhere lacks (some of) it
        if len(offsets) != self.tensors["offsets"].end - self.tensors["offsets"].begin:
            raise ShardError(f"{self.url}: the file ends before its offsets (cut short)")
        if list(tensor_from_bytes(offsets, torch.int64, (-1,)).tolist()) != list(index["offsets"]):
            raise ShardError(f"{self.name}: offsets differ from its index file")
        if whole:
            block, span = HeldRead(0, len(head), head), self.tensors["hidden_states"]
            for p in want:
                if span.begin + self._at[p + 1] <= len(head):
                    self._blocks[p] = block

    def _open_hidden(self, index: ShardIndex) -> None:
        """The hidden states' storage dtype, row shape and where each sample's bytes lie in their
        tensor (`_at`, per sample and the end): rows of the stored tensor, or coded bytes."""
        span, offsets = self.tensors["hidden_states"], index["offsets"]
        self.codec: str = index.get("codec", NONE)
        if self.codec == NONE:
            self.dtype: torch.dtype = span.dtype
            self._row_shape: tuple[int, ...] = tuple(span.shape[1:])
            self._at = [o * span.row_bytes for o in offsets]
            return
        meta = self.metadata
        if meta.get("codec") != self.codec:
            raise ShardError(f"{self.name}: holds codec {meta.get('codec')!r}, its index names {self.codec!r}")
        shape = json.loads(meta["hidden_states_shape"])
        dtype = getattr(torch, str(meta["hidden_states_dtype"]), None)
        if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != index["dtype"]:
            raise ShardError(
                f"{self.name}: hidden states {meta['hidden_states_dtype']}, its index says {index['dtype']}"
            )
        self.dtype, self._row_shape, self._at = dtype, tuple(shape[1:]), list(index["coded_offsets"])
        if span.dtype != torch.uint8 or len(shape) != 3 or shape[0] != offsets[-1] or span.shape[0] != self._at[-1]:
            raise ShardError(
                f"{self.name}: coded hidden states {span.dtype} {list(span.shape)} of {shape} do not fit its "
                f"index: {offsets[-1]} tokens in {self._at[-1]} coded bytes"
            )

    def _read_small(self, head: bytes) -> None:
        """The token ids, loss mask and offsets: from `head` (the opening read) where it holds them,
        else in one read where they lie together (as harvest packs them: last, in name order)."""
        spans = [self.tensors[name] for name in _SMALL]
        lo, hi = min(s.begin for s in spans), max(s.end for s in spans)
        if hi <= len(head):
            raw, at = memoryview(head), 0
        elif hi - lo <= sum(s.end - s.begin for s in spans) + BLOCK:
            raw, at = memoryview(self.loc.read_range(self.name, lo, hi)), lo
        else:
            return  # not together: each read whole on first use (`_whole`)
        for name, s in zip(_SMALL, spans, strict=True):
            self._small[name] = bytes(raw[s.begin - at : s.end - at])  # shorter where the file ends first
        scale = self.tensors.get(SCALE)
        if scale is not None and scale.end <= len(head):  # fp8, read whole: its scales came too
            self._small[SCALE] = bytes(head[scale.begin : scale.end])

    def __len__(self) -> int:
        return len(self.index["samples"])

    def _bytes(self, span: TensorSpan, start: int, end: int) -> bytes | bytearray:
        """Rows [start, end) of a tensor as stored; shorter where the shard file ends first."""
        rb = span.row_bytes
        return self._read(span.begin + start * rb, span.begin + end * rb)

    def _read(self, begin: int, end: int) -> bytes | bytearray:
        """Bytes [begin, end) of the shard file (shorter where it ends first): one ranged GET of an
        object store; from a local file, read straight into a buffer the sample's tensor then
        owns (no second copy: harvest.read.coalesce)."""
        if not self.loc.is_local or end <= begin:
            return self.loc.read_range(self.name, begin, end)
        buf = bytearray(end - begin)
        view, got = memoryview(buf), 0
        with self.loc.naming(self.name), self.loc.fs.open(self.loc.path(self.name), "rb") as f:
            f.seek(begin)
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        return buf if got == len(buf) else buf[:got]

    def _whole(self, name: str) -> bytes | bytearray:
        if name not in self._small:
            span = self.tensors[name]
            self._small[name] = self._bytes(span, 0, span.shape[0])
        return self._small[name]

    def _check(self, tensor: str, i: int, raw: memoryview, at: int) -> None:
        """Sample i's rows of `tensor` (`raw`, read from shard byte `at`) against its crc32."""
        span = self.tensors[tensor]
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        begin, end = span.begin + a * span.row_bytes, span.begin + b * span.row_bytes
        got = raw[begin - at : end - at]
        problem, expected, found = None, None, None
        if len(got) != end - begin:
            problem = f"are cut short: the shard file holds {len(got)} of its {end - begin} bytes there"
        elif tensor in self._slot:
            expected, found = self.index["crc32"][i][self._slot[tensor]], zlib.crc32(got)
            if found != expected:
                problem = f"have crc32 {found}, its index records {expected}"
        if problem:
            raise CorruptSample(
                self.url,
                self.index["shard_id"],
                self.index["samples"][i],
                tensor,
                begin,
                end,
                problem,
                verify_fix(self.loc),
                expected,
                found,
            )

    def rows(self, tensor: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of one tensor, as stored, each sample they touch checked against its
        crc32 (a range that cuts a sample reads its rows whole to check them): CorruptSample names
        the first that fails."""
        return self._rows(tensor, start, end, None)

    def _rows(self, tensor: str, start: int, end: int, held: Held | None) -> torch.Tensor:
        """`rows`, the hidden states' taken from `held` (bytes already read that hold those rows)
        when given."""
        offsets, span = self.index["offsets"], self.tensors[tensor]
        if tensor == "offsets":
            raise ShardError(f"{self.name}: offsets are not rows of tokens; the index holds them")
        if not 0 <= start <= end <= offsets[-1]:
            raise ShardError(f"{self.name}: rows [{start}, {end}) of {tensor} are outside its {offsets[-1]} rows")
        if start == end:
            if tensor == "hidden_states":
                return torch.empty((0, *self._row_shape), dtype=self.dtype)
            return torch.empty((0, *span.shape[1:]), dtype=span.dtype)
        first, last = bisect_right(offsets, start) - 1, bisect_left(offsets, end)  # samples [first, last) hold them
        lo, hi = offsets[first], offsets[last]
        if tensor == "hidden_states" and self.codec != NONE:
            parts = [self._decoded(i, held) for i in range(first, last)]
            whole = parts[0] if len(parts) == 1 else torch.cat(parts)
            return whole if (start, end) == (lo, hi) else whole[start - lo : end - lo].clone()
        cached = tensor in _SMALL or tensor == SCALE
        if cached:
            raw, at = memoryview(self._whole(tensor)), span.begin
        elif held is not None and tensor == "hidden_states":
            raw, at = held
        else:
            raw, at = memoryview(self._bytes(span, lo, hi)), span.begin + lo * span.row_bytes
        for i in range(first, last):
            self._check(tensor, i, raw, at)
        rb = span.row_bytes
        cut = raw[span.begin + start * rb - at : span.begin + end * rb - at]
        shape = (end - start, *span.shape[1:])
        if (
            not cached and not cut.readonly and len(cut) == len(raw) and len(cut)
        ):  # read for these rows alone: the tensor's own
            return torch.frombuffer(cut, dtype=torch.uint8).view(span.dtype).reshape(shape)
        return tensor_from_bytes(bytearray(cut), span.dtype, shape)

    def _decoded(self, i: int, held: Held | None) -> torch.Tensor:
        """Sample i's coded hidden states (from `held` where given), decoded and checked."""
        span, offsets = self.tensors["hidden_states"], self.index["offsets"]
        begin, end = span.begin + self._at[i], span.begin + self._at[i + 1]
        if held is not None and held[1] <= begin and end <= held[1] + len(held[0]):
            raw, at = held
        else:
            raw, at = memoryview(self._read(begin, end)), begin
        got = raw[begin - at : end - at]
        tokens = offsets[i + 1] - offsets[i]
        size = math.prod((tokens, *self._row_shape)) * self.dtype.itemsize
        problem = expected = found = data = None
        if len(got) != end - begin:
            problem = f"are cut short: the shard file holds {len(got)} of its {end - begin} coded bytes there"
        else:
            try:
                data = decode(got, size)
            except CodecError as e:
                problem = f"do not decode with its codec {self.codec}: {e}"
            else:
                if "hidden_states" in self._slot:
                    expected, found = self.index["crc32"][i][self._slot["hidden_states"]], zlib.crc32(data)
                    if found != expected:
                        problem = f"decode to bytes with crc32 {found}, its index records {expected}"
        if problem:
            raise CorruptSample(
                self.url,
                self.index["shard_id"],
                self.index["samples"][i],
                "hidden_states",
                begin,
                end,
                problem,
                verify_fix(self.loc),
                expected,
                found,
            )
        if not size:
            return torch.empty((tokens, *self._row_shape), dtype=self.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).reshape((tokens, *self._row_shape))

    def sample(self, i: int, dtype: torch.dtype | None = None, ahead: Sequence[int] = ()) -> dict[str, torch.Tensor]:
        """`input_ids` [T] int32, `loss_mask` [T] uint8 and `hidden_states` [T, K, H]: as stored
        when `dtype` is None (fp8 shards then add `hidden_scale` [T, K]), else converted to
        `dtype` (fp8 dequantized with its per-token scales). Every tensor checked (CorruptSample).
        `ahead`: the samples the caller expects to ask for next: those adjacent to i in storage
        (within GAP_BYTES, the reader's `cap` in all) are read with it, in one ranged read, and
        held for their own `sample` calls, as are the other runs of them, read when first asked
        for (`held_bytes`, `drop_held`)."""
        return self._decode(i, dtype, self._held(i, ahead))

    def samples(
        self, positions: Iterable[int], dtype: torch.dtype | None = None, cap: int | None = None, gap: int = GAP_BYTES
    ) -> Iterator[tuple[int, dict[str, torch.Tensor] | Exception]]:
        """`sample(p, dtype)` for each of `positions` (repeats once), read with one ranged read per
        run of them adjacent in storage (harvest.read.coalesce.runs: `gap`, `cap`, default the
        reader's), or from what the opening read held: (p, the sample, or the exception reading it raised: a CorruptSample fails
        its sample alone), those held first, then a run at a time, each in storage order."""
        held: dict[int, HeldRead] = {}
        rest: list[int] = []
        with self._lock:
            for p in dict.fromkeys(positions):
                block = self._blocks.pop(p, None)
                if block is None:
                    rest.append(p)
                else:
                    held[p] = block
        for p, block in sorted(held.items()):
            yield p, self._attempt(p, dtype, block.get(self._read))
        span, at = self.tensors["hidden_states"], self._at
        for run in runs(rest, at, 1, self.cap if cap is None else cap, gap):
            begin, end = span.begin + at[run[0]], span.begin + at[run[-1] + 1]
            try:
                got: Held | None = (memoryview(self._read(begin, end)), begin)
            except Exception:  # noqa: BLE001 - each sample of the run reads alone, and fails as it would have
                got = None
            for p in run:
                yield p, self._attempt(p, dtype, got)

    def _attempt(self, i: int, dtype: torch.dtype | None, held: Held | None) -> dict[str, torch.Tensor] | Exception:
        try:
            return self._decode(i, dtype, held)
        except Exception as e:  # noqa: BLE001 - handed to the caller in the sample's place
            return e

    def _held(self, i: int, ahead: Sequence[int]) -> Held | None:
        """Sample i's hidden-state bytes if read ahead, else read now, with the samples of `ahead`
        adjacent to it; the other runs of `ahead` are held to be read when first asked for."""
        with self._lock:
            block = self._blocks.pop(i, None)
            if block is None and ahead:
                span, at = self.tensors["hidden_states"], self._at
                fresh = [p for p in ahead if p != i and p not in self._blocks]
                for run in runs([i, *fresh], at, 1, self.cap):
                    if len(run) == 1 and run[0] != i:
                        continue  # one sample alone: read when asked for, as it would be
                    b = HeldRead(span.begin + at[run[0]], span.begin + at[run[-1] + 1])
                    for p in run:
                        if p == i:
                            block = b
                        else:
                            self._blocks[p] = b
        return None if block is None else block.get(self._read)

    def held_bytes(self) -> int:
        """Bytes read (or being read) ahead for samples not asked for yet."""
        with self._lock:
            return sum(b.end - b.begin for b in {id(b): b for b in self._blocks.values()}.values())

    def drop_held(self) -> None:
        """Forget what was read ahead (its samples are read again if asked for)."""
        with self._lock:
            self._blocks.clear()

    def _decode(self, i: int, dtype: torch.dtype | None, held: Held | None) -> dict[str, torch.Tensor]:
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        out = {name: self._rows(name, a, b, held) for name in ("input_ids", "loss_mask", "hidden_states")}
        if is_fp8(self.dtype):
            scale = self.rows(SCALE, a, b)
            if dtype is None or is_fp8(dtype):
                out[SCALE] = scale
            else:
                out["hidden_states"] = dequantize(out["hidden_states"], scale, dtype)
        elif dtype is not None and dtype != self.dtype:
            if is_fp8(dtype):
                raise ShardError(
                    f"{self.name}: stored as {self.dtype}; fp8 is chosen when the run is created, not on read"
                )
            out["hidden_states"] = out["hidden_states"].to(dtype)
        return out

    def check(self, i: int) -> list[CorruptSample]:
        """Every tensor of sample i checked (for `harvest reconcile --verify`): what fails, all of it."""
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        bad = []
        for name in sorted(set(self.tensors) - {"offsets"}):
            try:
                self.rows(name, a, b)
            except CorruptSample as e:
                bad.append(e)
        return bad
