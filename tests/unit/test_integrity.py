"""The output is the truth, and a run is never unreadable: a byte flipped in storage fails that one
sample (reader, both datasets) with a message naming it and the fix, `verify_run` finds it and
excludes it; a sample committed twice is read once everywhere, and `dedupe_run` excludes the
extra copy. Runs are built from real spool files packed by the real shard writer (no collector)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import zlib

import pytest
import torch
from torch.utils.data import DataLoader

from harvest.formats.index import ShardError, committed_samples, encode_index, index_file, parse_index
from harvest.formats.runfile import RUN_FILE
from harvest.formats.shard import encode_shard, plan_shard, shard_file
from harvest.formats.shard_write import write_shard
from harvest.formats.spool import inspect_sample
from harvest.node.spooldir import spool_path
from harvest.ops.dedupe import DedupeReport, dedupe_run
from harvest.ops.verify import Corruption, verify_run
from harvest.read.dataset import HiddenStateDataset
from harvest.read.feed import HiddenStateIterable
from harvest.read.reader import RunReader
from harvest.read.shard_reader import CorruptSample, ShardReader, UnreadableShard
from harvest.storage import Location
from tests.support.synth import HIDDEN, POINTS, make_config, spool_samples


def pack(loc: Location, cfg, spool: str, samples) -> str:
    """Pack `samples` (spooled in `spool`) into one committed shard of the run at `loc`: shard, then
    index, as the collector commits; returns the shard id."""
    entries = [inspect_sample(spool_path(spool, s.id), s.id, len(POINTS), HIDDEN, cfg.torch_dtype) for s in samples]
    plan = plan_shard(entries, cfg.run, cfg.capture_points, cfg.torch_dtype, codec=cfg.codec)
    if plan.needs_encoding:  # as the collector does, into a scratch file beside the spool
        plan = encode_shard(plan, os.path.join(spool, f".coded-{plan.shard_id}"))
    buf = io.BytesIO()
    sums = write_shard(plan, buf)
    loc.write_atomic(shard_file(plan.shard_id), buf.getvalue())
    loc.write_atomic(index_file(plan.shard_id), encode_index(plan.index(sums)))
    return plan.shard_id


def make_run(tmp_path, groups: list[list[int]], dtype: str = "bf16", seed0: int = 0, codec: str = "none"):
    """A committed run of one shard per group of sample indices into the samples spooled with
    lengths 5, 9, 3, 4, 6, 8 (a sample may be in two groups: two shards commit it), its hidden
    states coded by `codec`."""
    cfg = make_config(str(tmp_path / "out"), dtype=dtype, codec=codec)
    loc = Location.from_url(cfg.out_url).child(cfg.run)
    loc.write_atomic(RUN_FILE, cfg.to_json().encode())
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [5, 9, 3, 4, 6, 8], seed0)
    shards = [pack(loc, cfg, spool, [samples[i] for i in g]) for g in groups]
    return cfg, loc, samples, shards


def flip(loc: Location, shard_id: str, sample_id: str, tensor: str) -> tuple[int, int, int, int]:
    """Flip one byte in the middle of `sample_id`'s rows of `tensor` in its shard file; returns the
    rows' byte range in the file, the crc32 the index records (-1: none) and that of the bytes now."""
    index = parse_index(loc.read_json(index_file(shard_id)), "i")
    i = index["samples"].index(sample_id)
    span = ShardReader(loc, index).tensors[tensor]
    begin = span.begin + index["offsets"][i] * span.row_bytes
    end = span.begin + index["offsets"][i + 1] * span.row_bytes
    data = bytearray(loc.read_bytes(shard_file(shard_id)))
    data[(begin + end) // 2] ^= 0x10
    loc.write_atomic(shard_file(shard_id), bytes(data))  # local or s3: storage rotted under the index
    expected = index["crc32"][i][index["crc32_tensors"].index(tensor)] if "crc32" in index else -1
    return begin, end, expected, zlib.crc32(data[begin:end])


def corrupt_message(
    loc: Location, shard_id: str, sample_id: str, tensor: str, begin: int, end: int, expected: int, found: int
) -> str:
    return (
        f"{loc.path(shard_file(shard_id))}: sample {sample_id} is corrupt: tensor {tensor}, bytes [{begin}, {end}) "
        f"of the shard have crc32 {found}, its index records {expected}; run `harvest reconcile --verify --run r "
        f"--out {os.path.dirname(loc.root)}` to drop it from the index and extract it again"
    )


def raw(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def same_sample(got: dict, s) -> None:
    assert torch.equal(got["input_ids"], s.input_ids) and torch.equal(got["loss_mask"], s.loss_mask)
    assert torch.equal(got["hidden_states"].view(torch.uint8), s.hidden_states.view(torch.uint8))


def iterable_ids(url: str, samples, workers: int = 0, world_size: int = 1) -> list[str]:
    """The samples the iterable dataset yields over every rank and DataLoader worker, by token ids."""
    by_ids = {tuple(s.input_ids.tolist()): s.id for s in samples}
    seen = []
    for rank in range(world_size):
        ds = HiddenStateIterable(url, seed=3, rank=rank, world_size=world_size)
        for item in DataLoader(ds, batch_size=None, num_workers=workers):
            seen.append(by_ids[tuple(item["input_ids"].tolist())])
    return seen


@pytest.mark.parametrize("tensor", ["hidden_states", "input_ids"])
def test_a_flipped_byte_fails_that_sample_alone_until_verify_excludes_it(tmp_path, caplog, tensor):
    _, loc, samples, (a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]])
    victim = samples[1]
    begin, end, expected, found = flip(loc, a, victim.id, tensor)
    assert found != expected
    msg = corrupt_message(loc, a, victim.id, tensor, begin, end, expected, found)
    url = str(loc.root)

    reader = RunReader(url)
    with pytest.raises(CorruptSample) as e:
        reader.get(victim.id)
    assert str(e.value) == msg
    if tensor == "input_ids":
        with pytest.raises(CorruptSample, match=re.escape(msg)):
            reader.tokens(victim.id)
    else:  # the tokens are sound: a reader that needs only them (speculators' kept rows) still has them
        ids, mask = reader.tokens(victim.id)
        assert torch.equal(ids, victim.input_ids) and torch.equal(mask, victim.loss_mask)
    for s in samples[:5]:  # every other sample reads, from the same reader, the bad shard's included
        if s is not victim:
            same_sample(reader.get(s.id), s)
            assert [t.tolist() for t in reader.tokens(s.id)] == [s.input_ids.tolist(), s.loss_mask.tolist()]

    ds = HiddenStateDataset(url)
    k = ds.sample_ids.index(victim.id)
    with pytest.raises(CorruptSample) as e:
        ds[k]
    assert str(e.value) == msg
    assert [
        torch.equal(ds[i]["input_ids"], samples[j].input_ids.long())
        for i, j in ((ds.sample_ids.index(s.id), n) for n, s in enumerate(samples[:5]) if s is not victim)
    ] == [True] * 4

    caplog.set_level(logging.ERROR, "harvest.read")
    it = HiddenStateIterable(url)
    for _ in range(2):  # two epochs of one dataset: the sample is named once
        got = [item["input_ids"].tolist() for item in it]
        assert sorted(got) == sorted(s.input_ids.long().tolist() for s in samples[:5] if s is not victim)
    assert [r.getMessage() for r in caplog.records] == [f"skipping sample {victim.id} of shard {a}: {msg}"]

    rep = verify_run(loc)
    problem = f"have crc32 {found}, its index records {expected}"
    assert rep.corrupt == [Corruption(a, victim.id, tensor, begin, end, problem)] and rep.rewritten == []
    assert (rep.shards, rep.samples) == (2, 5)
    assert "excluded" not in loc.read_json(index_file(a))  # without `exclude` nothing is written

    seen = []
    rep = verify_run(loc, exclude=True, progress=lambda done, total: seen.append((done, total)))
    assert rep.rewritten == [a] and len(rep.corrupt) == 1 and seen == [(n, 5) for n in range(1, 6)]
    doc = parse_index(loc.read_json(index_file(a)), "a")
    assert doc["excluded"] == {victim.id: f"corrupt: tensor {tensor}, bytes [{begin}, {end}) {problem}"}
    assert committed_samples(doc) == [samples[0].id, samples[2].id]
    assert "excluded" not in loc.read_json(index_file(b))

    after = RunReader(url)
    assert victim.id not in after and len(after) == 4 and victim.id not in HiddenStateDataset(url).sample_ids
    assert after.total_tokens() == sum(s.num_tokens for s in samples[:5] if s is not victim)
    assert sorted(iterable_ids(url, samples)) == sorted(s.id for s in samples[:5] if s is not victim)
    again = verify_run(loc, exclude=True)  # nothing committed is corrupt any more: nothing rewritten
    assert (again.corrupt, again.rewritten, again.samples) == ([], [], 4)


def test_a_sample_in_two_shards_is_read_once_everywhere_until_dedupe_excludes_the_copy(tmp_path, caplog):
    _, loc, samples, shards = make_run(tmp_path, [[0, 1, 2], [2, 3, 4]])
    dup = samples[2]
    kept, other = sorted(shards)
    url = str(loc.root)
    caplog.set_level(logging.WARNING, "harvest.read")

    reader = RunReader(url)
    assert [r.getMessage() for r in caplog.records] == [
        (
            f"{url}: 1 sample is committed by more than one shard (e.g. {dup.id}, read from shard {kept}, also in "
            f"{other}); each is read once, from the shard with the smallest id; `harvest reconcile --dedupe` removes the "
            "extra copies from the index"
        )
    ]
    unique = [s.id for s in samples[:5]]
    assert len(reader) == 5 and sorted(reader.sample_ids) == sorted(unique) and reader.duplicates == {dup.id: [other]}
    assert reader.shard_of(dup.id) == kept and reader.shard_samples(kept).count(dup.id) == 1
    assert dup.id not in reader.shard_samples(other)
    assert sorted(reader.shard_samples(kept) + reader.shard_samples(other)) == sorted(unique)
    assert reader.total_tokens() == sum(s.num_tokens for s in samples[:5])
    assert reader.total_bytes() == sum(loc.size(shard_file(s)) for s in shards)  # both copies take space
    same_sample(reader.get(dup.id), dup)
    assert sorted(x["sample_id"] for x in reader) == sorted(unique)

    assert sorted(HiddenStateDataset(url).sample_ids) == sorted(unique) and len(HiddenStateDataset(url)) == 5
    assert sorted(iterable_ids(url, samples)) == sorted(unique)
    assert sorted(iterable_ids(url, samples, workers=2, world_size=2)) == sorted(unique)  # 2 ranks x 2 workers

    before = {s: raw(loc.path(index_file(s))) for s in shards}
    rep = dedupe_run(loc)
    assert rep == DedupeReport(samples=[dup.id], rewritten=[other])
    assert raw(loc.path(index_file(kept))) == before[kept]  # the kept copy's index is untouched
    doc = json.loads(raw(loc.path(index_file(other))))
    assert doc["excluded"] == {dup.id: f"duplicate: kept in shard {kept}"}
    assert raw(loc.path(index_file(other))) == encode_index({**json.loads(before[other]), "excluded": doc["excluded"]})
    after = {s: raw(loc.path(index_file(s))) for s in shards}
    assert dedupe_run(loc) == DedupeReport()  # a second run changes nothing
    assert {s: raw(loc.path(index_file(s))) for s in shards} == after

    caplog.clear()
    again = RunReader(url)
    assert caplog.records == [] and again.duplicates == {}  # the reader warns no more
    assert again.sample_ids == reader.sample_ids and again.shard_of(dup.id) == kept  # and reads the same copy


@pytest.mark.parametrize("damage", ["cut short", "header", "missing"])
def test_a_shard_that_cannot_be_opened_is_skipped_by_the_iterable_dataset_and_reported_whole(tmp_path, caplog, damage):
    _, loc, samples, (_a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]])
    path = loc.path(shard_file(b))
    if damage == "cut short":
        os.truncate(path, os.path.getsize(path) - 100)
        why = f"{path}: the file ends before its offsets (cut short)"
    elif damage == "header":
        data = bytearray(raw(path))
        data[8] ^= 0x01  # the header's opening brace: not JSON any more
        with open(path, "wb") as f:
            f.write(bytes(data))
        why = f"shards/{b}.safetensors: header is not JSON (Expecting value: line 1 column 1 (char 0))"
    else:
        os.unlink(path)
        why = f"the file {path} is missing"
    url = str(loc.root)
    msg = (
        f"shard {b} cannot be read ({why}); its 2 samples: run `harvest reconcile --verify --run r --out "
        f"{os.path.dirname(loc.root)}` to drop them from the index and extract them again"
    )
    reader = RunReader(url)
    with pytest.raises(UnreadableShard) as e:
        reader.get(samples[3].id)
    assert str(e.value) == msg
    same_sample(reader.get(samples[0].id), samples[0])  # the other shard reads
    caplog.set_level(logging.ERROR, "harvest.read")
    assert sorted(iterable_ids(url, samples)) == sorted(s.id for s in samples[:3])
    assert [r.getMessage() for r in caplog.records] == [f"skipping shard {b} (2 samples): {msg}"]
    rep = verify_run(loc, exclude=True)
    size = parse_index(loc.read_json(index_file(b)), "b")["bytes"]
    assert rep.corrupt == [Corruption(b, s.id, None, 0, size, f"cannot be read: {why}") for s in samples[3:5]]
    assert rep.rewritten == [b] and sorted(RunReader(url).sample_ids) == sorted(s.id for s in samples[:3])


def test_index_checksum_and_exclusion_fields_are_checked():
    from harvest.formats.index import FORMAT

    def doc(**extra):
        return {
            "format": FORMAT,
            "shard_id": "a" * 32,
            "shard": f"shards/{'a' * 32}.safetensors",
            "samples": ["s1", "s2"],
            "tokens": [3, 1],
            "offsets": [0, 3, 4],
            "bytes": 10,
            "sha256": "0" * 64,
            "dtype": "bfloat16",
            "capture_points": [2, 4, 5, 8],
            "final_state": "post-norm",
            **extra,
        }

    names = ["hidden_states", "input_ids", "loss_mask"]
    sums = {"crc32": [[1, 2, 3], [4, 5, 2**32 - 1]], "crc32_tensors": names}
    ok = parse_index(doc(**sums, excluded={"s1": "duplicate"}), "i")
    assert committed_samples(ok) == ["s2"] and committed_samples(parse_index(doc(**sums), "i")) == ["s1", "s2"]
    assert encode_index(ok) == json.dumps(ok, indent=1).encode()
    for bad, message in [
        (doc(crc32=[[1, 2, 3]], crc32_tensors=names), "i: 2 samples but 1 crc32 entries"),
        (
            doc(crc32=[[1, 2, 3], [4, 5]], crc32_tensors=names),
            "i: crc32 of sample 1 is not 3 unsigned 32-bit ints (one per tensor of ['hidden_states', 'input_ids', 'loss_mask'])",
        ),
        (doc(crc32=[[1, 2, 3], [4, 5, 2**32]], crc32_tensors=names), "i: crc32 of sample 1 is not 3 unsigned"),
        (doc(crc32=[[1, 2, 3], [4, 5, True]], crc32_tensors=names), "i: crc32 of sample 1 is not 3 unsigned"),
        (doc(crc32=[[1], [2]]), "i: index lacks its field 'crc32_tensors'"),
        (doc(crc32_tensors=names), "i: index lacks its field 'crc32'"),
        (doc(), "i: index lacks its field 'crc32'"),
        (doc(crc32=[[1], [2]], crc32_tensors=["x", "x"]), "i: index field 'crc32_tensors' is not a list of distinct"),
        (doc(**sums, excluded={"s3": "duplicate"}), "i: excludes 1 samples it does not hold (first s3)"),
        (doc(**sums, excluded=["s1"]), "i: index field 'excluded' is not an object of sample id to reason"),
        (doc(**sums, samples=["s1", "s1"]), "i: a sample is listed twice"),
    ]:
        with pytest.raises(ShardError, match=re.escape(message)):
            parse_index(bad, "i")
