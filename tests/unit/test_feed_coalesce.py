"""Coalesced reads: a shard's samples that a reader is about to read and that lie next to each other
in storage come from one ranged GET (counted at the real s3fs filesystem, against the S3 server),
and what comes out is what one read a sample gives, byte for byte: every crc32 still checked (a
corrupt sample fails alone, its neighbours in the same read do not), excluded samples never
yielded, the shuffled order and mid-epoch resume unchanged. And the planning rules, on plain
numbers (harvest.read.coalesce)."""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from harvest.formats.index import encode_index, index_file, parse_index, with_excluded
from harvest.formats.shard import shard_file
from harvest.read.coalesce import read_whole, runs, windows
from harvest.read.feed import HiddenStateIterable
from harvest.read.reader import RunReader
from harvest.read.shard_reader import CorruptSample, ShardReader
from tests.support.feedrun import FeedRun

SHARDS = [5, 3, 6]
TOKENS, HIDDEN = 64, 256
SAMPLE = TOKENS * 4 * HIDDEN * 2  # hidden-state bytes of one sample (bf16)


# -- the rules ---------------------------------------------------------------------------------------


def test_runs_join_what_is_adjacent_within_the_gap_and_the_cap():
    offsets = [0, 2, 5, 6, 10, 12]  # samples of 2, 3, 1, 4 and 2 rows; 10 bytes a row
    assert runs([4, 0, 1, 2, 1], offsets, 10, cap=1000, gap=0) == [[0, 1, 2], [4]]  # 3 is not asked for
    assert runs([0, 1, 2, 4], offsets, 10, cap=1000, gap=40) == [[0, 1, 2, 4]]  # read over 3 (40 bytes)
    assert runs([0, 1, 2, 4], offsets, 10, cap=1000, gap=39) == [[0, 1, 2], [4]]
    assert runs(range(5), offsets, 10, cap=50, gap=0) == [[0, 1], [2, 3], [4]]  # [0, 1, 2] would be 60 bytes
    assert runs(range(5), offsets, 10, cap=10, gap=0) == [[0], [1], [2], [3], [4]]  # longer than the cap: alone
    assert runs(range(5), offsets, 10, cap=0) == [[0], [1], [2], [3], [4]]
    assert runs([], offsets, 10) == []


def test_windows_keep_a_shards_stretch_together_where_it_fits():
    keys = [("a", i) for i in range(3)] + [("b", i) for i in range(4)] + [("c", 0)]
    by_shard = windows(keys, lambda k: 10, 50, lambda k: k[0])
    assert by_shard == [keys[:3], keys[3:8]]  # b's 4 do not fit after a's 3: b starts a window
    assert windows(keys, lambda k: 10, 50) == [keys[:5], keys[5:]]  # without shards: cut by bytes alone
    # stretches longer than the budget are cut by bytes alone
    assert windows(keys, lambda k: 10, 25, lambda k: k[0]) == [keys[:2], keys[2:4], keys[4:6], keys[6:]]
    assert windows(keys, lambda k: 10, 0) == [[k] for k in keys]
    assert windows(keys, lambda k: 99, 50) == [[k] for k in keys]  # a key bigger than the budget: alone


def test_a_shard_is_read_whole_only_when_small_and_mostly_wanted():
    assert read_whole(75, 100, 1 << 20, cap=2 << 20)
    assert not read_whole(74, 100, 1 << 20, cap=2 << 20)
    assert not read_whole(100, 100, 3 << 20, cap=2 << 20)  # longer than the cap
    assert not read_whole(100, 100, 1 << 20, cap=0) and not read_whole(100, 100, None)


# -- reads against the S3 server -----------------------------------------------------------------------


@pytest.fixture
def gets(monkeypatch):
    """Every ranged GET of a shard file the real s3fs filesystem makes: (shard file, start, end)."""
    import s3fs

    seen: list[tuple[str, int | None, int | None]] = []
    real = s3fs.S3FileSystem._cat_file

    async def counted(self, path, version_id=None, start=None, end=None, **kw):
        if path.endswith(".safetensors"):
            seen.append((path.rsplit("/", 1)[-1], start, end))
        return await real(self, path, version_id=version_id, start=start, end=end, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their sync methods when made
    yield seen
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3run(tmp_path, s3_bucket):
    run = FeedRun(tmp_path, sum(SHARDS), hidden=HIDDEN, tokens=TOKENS, out_url=f"{s3_bucket}/out")
    run.shards = run.commit_sizes(SHARDS)
    return run


def read_all(run: FeedRun, **kw) -> list[tuple[str, dict[str, torch.Tensor]]]:
    return [(run.sid(i), i) for i in HiddenStateIterable(run.url, **kw)]


def same(a: list[tuple[str, dict]], b: list[tuple[str, dict]]) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
        for (_, x), (_, y) in zip(a, b, strict=False)
    )


def per_shard(seen) -> Counter:
    return Counter(name for name, _, _ in seen)


@pytest.mark.parametrize("readahead", [0, 64 << 20])
def test_the_feed_reads_each_small_shard_in_one_get_and_the_same_bytes(s3run, gets, readahead):
    one_each = read_all(s3run, coalesce_bytes=0, readahead_bytes=readahead)
    alone = per_shard(gets)
    gets.clear()
    coalesced = read_all(s3run, readahead_bytes=readahead)  # the default: 64 MiB on an object store
    assert same(coalesced, one_each) and len(coalesced) == sum(SHARDS)
    # a read a sample: the header, the small tensors at the end, then each sample; coalesced: the
    # whole file, in the read that opens it
    assert alone == {shard_file(s).split("/")[-1]: 2 + n for s, n in zip(s3run.shards, SHARDS, strict=False)}
    assert per_shard(gets) == {shard_file(s).split("/")[-1]: 1 for s in s3run.shards}
    assert all(start == 0 for _, start, _ in gets)


def test_a_cap_below_the_shard_reads_adjacent_samples_in_runs_of_the_cap(s3run, gets):
    one_each = read_all(s3run, coalesce_bytes=0, readahead_bytes=0)
    gets.clear()
    got = read_all(s3run, coalesce_bytes=2 * SAMPLE, readahead_bytes=0)
    assert same(got, one_each)
    for shard, n in zip(s3run.shards, SHARDS, strict=False):  # header, small tensors, then runs of at most 2 samples
        mine = [(a, b) for name, a, b in gets if name == shard_file(shard).split("/")[-1]]
        runs_read = [b - a for a, b in mine[2:]]
        assert set(runs_read) <= {SAMPLE, 2 * SAMPLE} and sum(runs_read) == n * SAMPLE
        assert len(runs_read) <= n // 2 + 1 < n


def test_a_corrupt_sample_in_a_coalesced_read_fails_alone_and_is_named_once(s3run, gets, caplog):
    shard, victim = s3run.shards[0], s3run.ids[2]  # the middle of the first shard's one read
    flip(s3run, shard, victim)
    one_each = read_all(s3run, coalesce_bytes=0, readahead_bytes=0)
    gets.clear()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="harvest.read"):
        got = read_all(s3run)
    assert same(got, one_each) and victim not in dict(got) and len(got) == sum(SHARDS) - 1
    assert per_shard(gets)[shard_file(shard).split("/")[-1]] == 1  # still one read: the check is per sample
    named = [r.getMessage() for r in caplog.records if victim in r.getMessage()]
    assert len(named) == 1 and "is corrupt: tensor hidden_states" in named[0]
    # the random-access reader, reading ahead in storage order, fails that sample alone too
    reader = RunReader(s3run.url)
    for sid in reader.sample_ids:
        if sid == victim:
            with pytest.raises(CorruptSample, match=victim):
                reader.get(sid)
        else:
            assert torch.equal(reader.get(sid)["input_ids"], dict(one_each)[sid]["input_ids"].to(torch.int32))


def test_excluded_samples_are_skipped_and_read_over(s3run, gets):
    shard = s3run.shards[2]
    doc = parse_index(s3run.loc.read_json(index_file(shard)), "i")
    gone = doc["samples"][3]  # in the middle of the shard's 6
    s3run.loc.write_atomic(index_file(shard), encode_index(with_excluded(doc, {gone: "corrupt: test"})))
    one_each = read_all(s3run, coalesce_bytes=0, readahead_bytes=0)
    gets.clear()
    got = read_all(s3run, coalesce_bytes=6 * SAMPLE, readahead_bytes=0)
    assert same(got, one_each) and gone not in dict(got) and len(got) == sum(SHARDS) - 1
    mine = [(a, b) for name, a, b in gets if name == shard_file(shard).split("/")[-1]]
    # the shard's file is longer than the cap: its header, its small tensors, then its 5 committed
    # samples in one GET that reads over the excluded one (shorter than GAP_BYTES), never yielded
    span = ShardReader(s3run.loc, doc, cap=0).tensors["hidden_states"]
    assert mine[2:] == [(span.begin, span.begin + 6 * SAMPLE)] and len(mine) == 3


def test_the_random_access_reader_reads_ahead_only_in_order_and_gives_the_same_bytes(s3run, gets):
    plain = RunReader(s3run.url, coalesce_bytes=0)
    expect = {sid: plain.get(sid) for sid in plain.sample_ids}
    alone = len(gets)
    gets.clear()
    reader = RunReader(s3run.url)
    got = {sid: reader.get(sid) for sid in reader.sample_ids}
    assert all(torch.equal(got[s]["hidden_states"], expect[s]["hidden_states"]) for s in expect)
    counts = per_shard(gets)
    assert sum(counts.values()) < alone
    # the window grows along the first shard (in storage order: by id) and carries on: every later
    # shard is one GET
    assert [counts[shard_file(s).split("/")[-1]] for s in sorted(s3run.shards)[1:]] == [1, 1]
    assert reader.held_bytes() == 0  # everything read ahead was asked for
    # threads asking in order (a loader's workers) get the same bytes
    gets.clear()
    shared = RunReader(s3run.url)
    with ThreadPoolExecutor(4) as pool:
        threaded = dict(zip(shared.sample_ids, pool.map(shared.get, shared.sample_ids), strict=False))
    assert all(torch.equal(threaded[s]["hidden_states"], expect[s]["hidden_states"]) for s in expect)
    assert len(gets) < alone


def test_a_reader_asked_out_of_order_reads_nothing_ahead(tmp_path, s3_bucket, gets):
    run = FeedRun(tmp_path, 16, hidden=HIDDEN, tokens=TOKENS, out_url=f"{s3_bucket}/out")
    run.commit_sizes([2] * 8)
    reader = RunReader(run.url)
    order = reader.sample_ids
    # never a request just after one of the last few, nor in the shard of the one before or the next
    jumps = [order[k] for k in (15, 4, 14, 1, 13, 0)]
    for sid in jumps:
        reader.get(sid)
    ranged = [b - a for _, a, b in gets if a != 0 and b - a >= SAMPLE]
    assert ranged == [SAMPLE] * len(jumps) and reader.held_bytes() == 0  # one sample a GET, nothing more


# -- order, resume and checks with coalescing forced on a local run ----------------------------------------


def test_shuffled_order_and_resume_are_those_of_one_read_a_sample(tmp_path):
    run = FeedRun(tmp_path, sum(SHARDS), hidden=HIDDEN, tokens=TOKENS)
    run.commit_sizes(SHARDS)
    kw = {"seed": 9, "window": 2, "rank": 1, "world_size": 2}
    alone = [run.sid(i) for i in HiddenStateIterable(run.url, coalesce_bytes=0, **kw)]
    feed = HiddenStateIterable(run.url, coalesce_bytes=3 * SAMPLE, **kw)  # forced in a local folder
    assert [run.sid(i) for i in feed] == alone
    first = []
    for item in feed:
        first.append(run.sid(item))
        if len(first) == 3:
            break
    state = feed.state_dict()
    resumed = HiddenStateIterable(run.url, coalesce_bytes=3 * SAMPLE, **kw)
    resumed.load_state_dict(state)
    assert first + [run.sid(i) for i in resumed] == alone


def test_a_local_reader_reads_one_sample_a_request_into_the_tensor_it_hands_out(tmp_path):
    run = FeedRun(tmp_path, 4, hidden=HIDDEN, tokens=TOKENS)
    (shard,) = run.commit_sizes([4])
    doc = parse_index(run.loc.read_json(index_file(shard)), "i")
    reader = ShardReader(run.loc, doc, want=range(4))
    assert reader.cap == 0 and reader.held_bytes() == 0  # a local folder: nothing coalesced, nothing held
    a, b = reader.sample(1), reader.sample(1)
    assert torch.equal(a["hidden_states"], b["hidden_states"])
    a["hidden_states"].zero_()  # each sample owns its buffer: a caller writing to it changes no other
    assert not torch.equal(a["hidden_states"], reader.sample(1)["hidden_states"])
    assert torch.equal(reader.sample(1)["hidden_states"], b["hidden_states"])
    assert torch.equal(reader.sample(1)["input_ids"], run.samples[1].input_ids)


def flip(run: FeedRun, shard: str, sample_id: str) -> None:
    """One byte of `sample_id`'s hidden states changed in its shard file, its index left as it was."""
    doc = parse_index(run.loc.read_json(index_file(shard)), "i")
    i = doc["samples"].index(sample_id)
    span = ShardReader(run.loc, doc, cap=0).tensors["hidden_states"]
    data = bytearray(run.loc.read_bytes(shard_file(shard)))
    data[span.begin + (doc["offsets"][i] + doc["offsets"][i + 1]) // 2 * span.row_bytes] ^= 0x10
    run.loc.write_atomic(shard_file(shard), bytes(data))
