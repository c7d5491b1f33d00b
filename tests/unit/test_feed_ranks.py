"""The training feed over a real committed run of uneven shards: every rank and DataLoader worker
gets the same number of samples per epoch to within one, and so does every rank (exactly one
count with drop_remainder), contiguous spans of a seeded shard-local order, and the union over ranks and
workers is every sample once, each epoch in another order; ranks of a torch.distributed job that
list a live run at different moments deal rank 0's view."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from harvest.errors import ConfigurationError
from harvest.formats.settled import write_settled
from harvest.read.feed import HiddenStateIterable
from tests.support.feedrun import FeedRun

SHARDS = [1, 7, 2, 5, 3, 9, 4]  # 31 samples


class Tagged(IterableDataset):
    """The feed, each item tagged with the DataLoader worker that read it."""

    def __init__(self, feed: HiddenStateIterable) -> None:
        self.feed = feed

    def __iter__(self):
        info = get_worker_info()
        for item in self.feed:
            yield {"worker": info.id if info is not None else 0, "input_ids": item["input_ids"]}


def read_epoch(run: FeedRun, world_size: int, workers: int, epoch: int = 0, **kw) -> dict[tuple[int, int], list[str]]:
    """(rank, worker) -> the samples it yielded, in order."""
    got: dict[tuple[int, int], list[str]] = {}
    for rank in range(world_size):
        feed = HiddenStateIterable(run.url, seed=5, rank=rank, world_size=world_size, window=2, **kw)
        feed.set_epoch(epoch)
        for w in range(max(workers, 1)):
            got[(rank, w)] = []
        for x in DataLoader(Tagged(feed), batch_size=None, num_workers=workers):
            got[(rank, int(x["worker"]))].append(run.sid(x))
    return got


@pytest.fixture
def run(tmp_path):
    r = FeedRun(tmp_path, sum(SHARDS))
    r.commit_sizes(SHARDS)
    return r


@pytest.mark.parametrize("world_size,workers", [(2, 0), (3, 0), (2, 2), (3, 2)])
def test_every_rank_and_worker_gets_an_equal_share_and_together_every_sample_once(run, world_size, workers):
    got = read_epoch(run, world_size, workers)
    counts = [len(v) for v in got.values()]
    parts = world_size * max(workers, 1)
    assert len(got) == parts and max(counts) - min(counts) <= 1 and sum(counts) == 31
    everything = [s for v in got.values() for s in v]
    assert sorted(everything) == sorted(run.ids)  # each once
    ranks = [sum(len(v) for (r, _), v in got.items() if r == rank) for rank in range(world_size)]
    assert max(ranks) - min(ranks) <= 1, ranks  # every rank within one of every other
    # the spans are the contiguous cuts of one order, in worker-major order of (rank, worker)
    feed = HiddenStateIterable(run.url, seed=5, window=2)
    order = [s for sp in [got[k] for k in sorted(got, key=lambda k: (k[1], k[0]))] for s in sp]
    assert order == feed.samples()  # one rank, in-process: the whole order
    if workers == 0:  # (the same order dealt: with workers too, as checked just above)
        assert read_epoch(run, world_size, workers) == got  # deterministic
        other = read_epoch(run, world_size, workers, epoch=1)
        assert sorted(s for v in other.values() for s in v) == sorted(run.ids) and other != got


@pytest.mark.parametrize("world_size,workers", [(2, 2), (3, 0)])
def test_drop_remainder_gives_every_part_exactly_the_same_count(run, world_size, workers):
    got = read_epoch(run, world_size, workers, drop_remainder=True)
    parts = world_size * max(workers, 1)
    assert {len(v) for v in got.values()} == {31 // parts}
    assert len({s for v in got.values() for s in v}) == 31 - 31 % parts


def test_items_are_the_samples_and_the_feed_refuses_a_loader_of_another_shape(run):
    feed = HiddenStateIterable(run.url, num_workers=2, readahead_bytes=0)
    with pytest.raises(ConfigurationError, match="the feed was told num_workers=2, its DataLoader runs 0: give both"):
        next(iter(feed))
    with pytest.raises(ConfigurationError, match=r"rank 2 of world size 2"):
        HiddenStateIterable(run.url, rank=2, world_size=2)
    by_id = {s.id: s for s in run.samples}
    items = list(HiddenStateIterable(run.url, dtype=torch.float32))
    assert len(items) == 31
    for item in items:
        s = by_id[run.sid(item)]
        hs = s.hidden_states.float()
        assert torch.equal(item["hidden_state"], hs[:, 3])
        assert torch.equal(item["aux_hidden_state"], torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], dim=-1))
        assert torch.equal(item["loss_mask"], s.loss_mask.long())


def _rank_main(rank: int, url: str, init: str, out: str, newest: str) -> None:
    """One rank of a 2-process gloo job; rank 1 lists the run a moment before `newest` was committed."""
    import json

    import torch.distributed as dist

    import harvest.read.feed as ds

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:
        listed = ds.list_shards
        ds.list_shards = lambda loc: [s for s in listed(loc) if s != newest]  # an earlier moment's listing
    feed = ds.HiddenStateIterable(url, seed=2, rank=rank, world_size=2, window=2)
    got = [str(x["input_ids"].tolist()) for x in feed]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"view": feed._view, "got": got}, f)
    dist.destroy_process_group()


def test_ranks_that_list_a_live_run_at_different_moments_deal_rank_0s_view(tmp_path):
    import json

    import torch.multiprocessing as mp

    run = FeedRun(tmp_path, 34)
    run.commit_sizes(SHARDS)
    newest = run.commit([31, 32, 33])  # committed between the two ranks' listings
    out = str(tmp_path / "ranks")
    mp.start_processes(
        _rank_main, args=(run.url, f"file://{tmp_path / 'rdv'}", out, newest), nprocs=2, join=True, start_method="spawn"
    )
    got = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert got[0]["view"] == got[1]["view"] and newest in got[1]["view"]
    by = {str(s.input_ids.long().tolist()): s.id for s in run.samples}
    read = [by[t] for g in got for t in g["got"]]
    assert sorted(read) == sorted(run.ids)  # each once, though rank 1's own listing lacked a shard


def test_ranks_following_a_live_run_without_torch_distributed_are_warned(tmp_path, caplog):
    """Without torch.distributed each rank lists the run on its own: on a live run a shard committed
    between two ranks' listings would be read twice or never (the job above agrees), so the feed
    says so; a settled run, or one feed not following, lists the same for every rank: no word."""
    run = FeedRun(tmp_path, 6)
    run.commit_sizes([3, 3])
    with caplog.at_level("WARNING", logger="harvest.read"):
        HiddenStateIterable(run.url, rank=1, world_size=2, follow=True)
        HiddenStateIterable(run.url, rank=1, world_size=2)
        HiddenStateIterable(run.url, follow=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"rank 1 of 2 lists the live run {run.url} on its own (no torch.distributed): a shard committed between "
        "the ranks' listings is read twice or never"
    ]
    caplog.clear()
    write_settled(run.loc, run.cfg.run, 6, 0)
    with caplog.at_level("WARNING", logger="harvest.read"):
        HiddenStateIterable(run.url, rank=1, world_size=2, follow=True)
    assert caplog.records == []
