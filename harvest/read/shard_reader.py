"""Reading one committed shard by byte ranges, from any fsspec store, every sample checked.

Opening a shard costs one ranged read (the safetensors header; a second one only if the
header is longer than the first guess); the token ids, loss mask, offsets and fp8 scales are
small (a few bytes a token) and fetched whole once; each sample's hidden states are then one
ranged read of exactly its rows. A trainer on S3 never downloads a shard it only samples from.

Every range handed out is checked against the per-sample crc32s its index records (written at
pack time, harvest.formats.shard): a byte that rotted in storage, or was cut short, fails that
one sample with `CorruptSample`, naming the shard file, the sample, the tensor, the byte range
and the fix, and the reader stays usable for every other sample. Index files written before the
checksums were recorded are read unchecked.
"""

from __future__ import annotations

import json
import posixpath
import zlib
from bisect import bisect_left, bisect_right

import torch

from harvest.formats.fp8 import dequantize, is_fp8
from harvest.formats.index import ShardError, ShardIndex
from harvest.formats.shard import shard_file
from harvest.formats.spool import SCALE
from harvest.formats.stformat import BLOCK, FormatError, TensorSpan, header_length, parse_header, tensor_from_bytes
from harvest.storage import Location

_SMALL = ("input_ids", "loss_mask", "offsets")


def object_url(loc: Location, name: str) -> str:
    """`name` of `loc` as a user types it: a path for a local folder, else its URL."""
    return loc.path(name) if loc.is_local else loc.fs.unstrip_protocol(loc.path(name))


def verify_fix(loc: Location, plural: bool = False) -> str:
    """The command that drops a run's corrupt samples from its index files so that they are
    extracted again (`loc` is the run's folder, `<out>/<run>`)."""
    run = posixpath.basename(loc.root)
    out = posixpath.dirname(loc.root) if loc.is_local else loc.url().rsplit("/", 1)[0]
    it = "them" if plural else "it"
    return f"run `harvest reconcile --verify --run {run} --out {out}` to drop {it} from the index and extract {it} again"


class CorruptSample(ShardError):
    """One sample's stored bytes differ from what was packed (its crc32), or are cut short."""

    def __init__(self, shard_url: str, shard_id: str, sample_id: str, tensor: str, begin: int, end: int,
                 problem: str, fix: str, expected: int | None = None, found: int | None = None) -> None:
        self.shard_url, self.shard_id, self.sample_id, self.tensor = shard_url, shard_id, sample_id, tensor
        self.begin, self.end, self.problem, self.expected, self.found = begin, end, problem, expected, found
        super().__init__(f"{shard_url}: sample {sample_id} is corrupt: tensor {tensor}, bytes [{begin}, {end}) of "
                         f"the shard {problem}; {fix}")


class UnreadableShard(ShardError):
    """A committed shard that cannot be opened at all (its file missing, its header or offsets
    damaged): every sample it commits is lost with it."""

    def __init__(self, shard_id: str, why: str, samples: int, fix: str) -> None:
        self.shard_id, self.why = shard_id, why
        super().__init__(f"shard {shard_id} cannot be read ({why}); its {samples} samples: {fix}")


class ShardReader:
    """Random access into one committed shard (`index`: its parsed index, harvest.formats.index)."""

    def __init__(self, loc: Location, index: ShardIndex) -> None:
        try:
            self._open(loc, index)
        # what damaged header bytes raise as they are parsed (a flipped byte can break the JSON, a key
        # or a number); a missing file; ShardError for a header that parses but disagrees with the index
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            if isinstance(e, FileNotFoundError):
                why = f"the file {object_url(loc, shard_file(index['shard_id']))} is missing"
            else:
                why = str(e) if isinstance(e, ShardError) else f"its header is damaged: {type(e).__name__}: {e}"
            raise UnreadableShard(index["shard_id"], why, len(index["samples"]), verify_fix(loc, plural=True)) from None

    def _open(self, loc: Location, index: ShardIndex) -> None:
        self.loc, self.index = loc, index
        self.name: str = shard_file(index["shard_id"])  # from the checked id, never a path read from storage
        if index.get("shard", self.name) != self.name:
            raise ShardError(f"index of shard {index['shard_id']} names {index['shard']!r}, expected {self.name}")
        self.url = object_url(loc, self.name)
        # The header is ~0.5 KiB plus the sample ids (35 bytes each), padded so the data starts on a
        # block (stformat.BLOCK): guess that, rounded up to a block, so one read usually does.
        guess = 1024 + 40 * len(index["samples"])
        head = loc.read_range(self.name, 0, -(-guess // BLOCK) * BLOCK)
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
            raise ShardError(f"{self.name}: its index has crc32s of tensors {names}, the shard holds {sorted(self.tensors)}")
        self._slot = {name: j for j, name in enumerate(names)}
        self.dtype: torch.dtype = self.tensors["hidden_states"].dtype
        self._small: dict[str, bytes] = {}
        offsets = self._whole("offsets")  # the last tensor: a shard cut short anywhere lacks (some of) it
        if len(offsets) != self.tensors["offsets"].end - self.tensors["offsets"].begin:
            raise ShardError(f"{self.url}: the file ends before its offsets (cut short)")
        if list(tensor_from_bytes(offsets, torch.int64, (-1,)).tolist()) != list(index["offsets"]):
            raise ShardError(f"{self.name}: offsets differ from its index file")

    def __len__(self) -> int:
        return len(self.index["samples"])

    def _bytes(self, span: TensorSpan, start: int, end: int) -> bytes:
        """Rows [start, end) of a tensor as stored; shorter where the shard file ends first."""
        rb = span.row_bytes
        return self.loc.read_range(self.name, span.begin + start * rb, span.begin + end * rb)

    def _whole(self, name: str) -> bytes:
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
            raise CorruptSample(self.url, self.index["shard_id"], self.index["samples"][i], tensor, begin, end,
                                problem, verify_fix(self.loc), expected, found)

    def rows(self, tensor: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of one tensor, as stored, each sample they touch checked against its
        crc32 (a range that cuts a sample reads its rows whole to check them): CorruptSample names
        the first that fails."""
        offsets, span = self.index["offsets"], self.tensors[tensor]
        if tensor == "offsets":
            raise ShardError(f"{self.name}: offsets are not rows of tokens; the index holds them")
        if not 0 <= start <= end <= offsets[-1]:
            raise ShardError(f"{self.name}: rows [{start}, {end}) of {tensor} are outside its {offsets[-1]} rows")
        if start == end:
            return torch.empty((0, *span.shape[1:]), dtype=span.dtype)
        first, last = bisect_right(offsets, start) - 1, bisect_left(offsets, end)  # samples [first, last) hold them
        lo, hi = offsets[first], offsets[last]
        if tensor in _SMALL or tensor == SCALE:
            raw, at = memoryview(self._whole(tensor)), span.begin
        else:
            raw, at = memoryview(self._bytes(span, lo, hi)), span.begin + lo * span.row_bytes
        for i in range(first, last):
            self._check(tensor, i, raw, at)
        rb = span.row_bytes
        cut = raw[span.begin + start * rb - at : span.begin + end * rb - at]
        return tensor_from_bytes(bytearray(cut), span.dtype, (end - start, *span.shape[1:]))

    def sample(self, i: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """`input_ids` [T] int32, `loss_mask` [T] uint8 and `hidden_states` [T, K, H]: as stored
        when `dtype` is None (fp8 shards then add `hidden_scale` [T, K]), else converted to
        `dtype` (fp8 dequantized with its per-token scales). Every tensor checked (CorruptSample)."""
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        out = {name: self.rows(name, a, b) for name in ("input_ids", "loss_mask", "hidden_states")}
        if is_fp8(self.dtype):
            scale = self.rows(SCALE, a, b)
            if dtype is None or is_fp8(dtype):
                out[SCALE] = scale
            else:
                out["hidden_states"] = dequantize(out["hidden_states"], scale, dtype)
        elif dtype is not None and dtype != self.dtype:
            if is_fp8(dtype):
                raise ShardError(f"{self.name}: stored as {self.dtype}; fp8 is chosen when the run is created, not on read")
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
