"""Mid-epoch resume of the training feed over a real run: a state taken after some batches (in
process, or with 2 DataLoader workers and batches of 3) and loaded into fresh feeds yields exactly
the samples no rank's loop was handed: none twice, none skipped, also into another world size or
worker count, and again from a state taken inside a resumed epoch. A run whose index changed
under a state is refused."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from harvest.errors import ConfigurationError
from harvest.formats.index import ShardError, encode_index, index_file, with_excluded
from harvest.read.feed import HiddenStateIterable
from tests.support.feedrun import FeedRun

SHARDS = [4, 1, 6, 3, 8, 2, 5, 4]  # 33 samples


@pytest.fixture
def run(tmp_path):
    r = FeedRun(tmp_path, sum(SHARDS))
    r.commit_sizes(SHARDS)
    return r


def feeds(run, world_size, workers, batch_size, state=None, epoch=2):
    out = []
    for rank in range(world_size):
        f = HiddenStateIterable(
            run.url, seed=9, rank=rank, world_size=world_size, batch_size=batch_size, num_workers=workers, window=3
        )
        f.set_epoch(epoch)
        if state is not None:
            f.load_state_dict(state)
        out.append(f)
    return out


def take(run, feed, workers, batch_size, batches=None):
    """The samples `batches` batches of this rank's DataLoader hand its loop (None: all)."""
    loader = DataLoader(feed, batch_size=batch_size, num_workers=workers, collate_fn=list)
    got = []
    if batches == 0:
        return got
    for k, batch in enumerate(loader, 1):
        got += [run.sid(x) for x in batch]
        if k == batches:  # the loop stops here to save: it asks for no further batch
            break
    return got


def once(got, run):
    assert len(got) == len(set(got)), "a sample twice"
    assert sorted(got) == sorted(run.ids), "a sample skipped"


@pytest.mark.parametrize(
    "world_size,workers,batch_size,batches,handed,then",
    [
        (1, 0, 1, 7, 7, (1, 0)),  # in process, no batching
        (2, 0, 3, 2, 12, (2, 0)),
        (2, 2, 3, 3, 18, (2, 2)),  # 2 DataLoader workers: each loop saw batches of worker 0, 1, 0
        (2, 2, 3, 3, 18, (3, 1)),  # resumed into another world size and worker count
        # spans 6, 6, 6 | 5, 5, 5 (worker 0's of ranks 0-2, then worker 1's): 5 batches of 2 hand 10 on every rank
        (3, 2, 2, 5, 30, (1, 2)),
    ],
)
def test_a_resumed_epoch_yields_exactly_what_no_loop_was_handed(
    run, world_size, workers, batch_size, batches, handed, then
):
    before = []
    first = feeds(run, world_size, workers, batch_size)
    for f in first:
        before += take(run, f, workers, batch_size, batches)
    assert len(before) == handed
    state = first[0].state_dict(batches=batches) if workers else first[0].state_dict()
    if not workers:  # in process the feed counted what it yielded: the same state as when told
        assert state == first[0].state_dict(batches=batches)
    assert state["epoch"] == 2 and len(state["stages"]) == 1
    world2, workers2 = then
    after = []
    for f in feeds(run, world2, workers2, batch_size, state=state, epoch=2):
        after += take(run, f, workers2, batch_size)
    once(before + after, run)
    # the next epoch is whole again
    nxt = []
    for f in feeds(run, world2, workers2, batch_size, state=state, epoch=2):
        f.set_epoch(3)
        nxt += take(run, f, workers2, batch_size)
    once(nxt, run)


@pytest.mark.parametrize("world_size,workers", [(3, 2), (2, 4), (4, 2)])
def test_ranks_read_the_same_number_of_samples_to_within_one(run, world_size, workers):
    counts = [len(take(run, f, workers, 1)) for f in feeds(run, world_size, workers, 1)]
    assert sum(counts) == sum(SHARDS) and max(counts) - min(counts) <= 1, counts


def test_a_state_taken_inside_a_resumed_epoch_resumes_it_again(run):
    seen = []
    a = feeds(run, 2, 2, 2)
    for f in a:
        seen += take(run, f, 2, 2, 3)
    s1 = a[0].state_dict(batches=3)
    b = feeds(run, 3, 0, 2, state=s1)
    for f in b:
        seen += take(run, f, 0, 2, 2)
    s2 = b[1].state_dict()  # in process: what rank 1 yielded, 2 batches on every rank
    assert len(s2["stages"]) == 2
    for f in feeds(run, 1, 2, 2, state=s2):
        seen += take(run, f, 2, 2)
    once(seen, run)


def test_states_the_feed_cannot_honour_are_refused_by_name(run, tmp_path):
    f = feeds(run, 2, 2, 3)[0]
    with pytest.raises(ConfigurationError, match=r"pass state_dict\(batches=<batches taken this epoch>\)"):
        f.state_dict()
    state = f.state_dict(batches=1)
    other = HiddenStateIterable(run.url, seed=10, window=3)
    with pytest.raises(ConfigurationError, match="seed 9, window 3; this feed reads run 'r' with seed 10"):
        other.load_state_dict(state)
    # a repair rewrote an index of the state's view: its order is not the saved one any more
    shard = state["shards"][0]
    doc = run.loc.read_json(index_file(shard))
    run.loc.write_atomic(index_file(shard), encode_index(with_excluded(doc, {doc["samples"][0]: "corrupt: test"})))
    with pytest.raises(ShardError, match="changed since it was saved"):
        feeds(run, 2, 2, 3)[0].load_state_dict(state)
