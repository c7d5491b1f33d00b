"""A spooled sample's owner lives in its state value (`s:<spool>`, harvest/state/lua/lib/state_value.lua), and a
ledger an older harvest wrote (a bare `s`, its owner in the spool_owner hash) still reads, moves,
fences and checks right: a run's Redis outlives an upgrade of its workers and collectors."""

from harvest.ops.ledgercheck import check_ledger
from harvest.state.ledger import Ledger
from harvest.state.packing import PackingRecord, PackingRecords

A, B, C, D = "a" * 32, "b" * 32, "c" * 32, "d" * 32


def _raw(conn, led, *ids):
    return [conn.hget(led.keys.state, i) for i in ids]


def test_a_spooled_samples_owner_is_written_with_its_state_and_leaves_with_it(conn):
    led = Ledger(conn, "so1")
    led.add_queued([A, B, C])
    assert led.mark_spooled([A, B], owner="spool1") == [A, B]
    assert led.mark_spooled([C]) == [C]  # spooled without an owner
    assert _raw(conn, led, A, B, C) == [b"s:spool1", b"s:spool1", b"s:"]
    assert conn.exists(led.keys.spool_owner) == 0
    assert led.states([A, C, D]) == ["s", "s", None]
    assert led.states_and_owners([A, C, D]) == (["s", "s", None], ["spool1", None, None])
    assert led.take([A, B]) == ["s", "s"]
    assert conn.hgetall(led.keys.spool_counts) == {b"spool1": b"2"}
    conn.set("rec", "r0")  # the record the collector wrote before packing
    assert led.fence_commit("spool2", [A], "rec", "r1", before="r0") is False
    assert led.fence_commit("spool", [A], "rec", "r1", before="r0") is False  # a spool whose id starts another's
    assert led.fence_commit("spool1", [A, B, D], "rec", "r1", before="r0") is False  # D is not spooled
    assert led.fence_commit("spool1", [A, B], "rec", "r1", before="r1") is False  # not the record it wrote
    assert led.fence_commit("spool1", [A, B, C], "rec", "r1", before="r0") is True  # C spooled without an owner
    assert led.mark_done([A]) == [A]
    assert _raw(conn, led, A) == [b"d"] and conn.hgetall(led.keys.spool_counts) == {b"spool1": b"1"}
    assert led.owned_by("spool1") == [B]
    assert led.reclaim("spool1", [B, C]) == [B]
    assert _raw(conn, led, B) == [b"q"] and conn.exists(led.keys.spool_counts) == 0
    rep = check_ledger(conn, "so1")
    assert rep.ok and rep.by_state == {"q": 1, "s": 1, "d": 1, "f": 0}


def _older_harvests_ledger(conn, run: str) -> Ledger:
    """A, B spooled by spool1 and C without an owner, as a harvest before fused owners wrote them."""
    led = Ledger(conn, run)
    k = led.keys
    conn.hset(k.state, mapping={A: "s", B: "s", C: "s", D: "q"})
    conn.hset(k.spool_owner, mapping={A: "spool1", B: "spool1", C: ""})
    conn.hset(k.counts, mapping={"s": 3, "q": 1})
    conn.hset(k.spool_counts, "spool1", 2)
    return led


def test_an_older_harvests_bare_s_reads_fences_and_moves_with_its_owner_from_the_spool_owner_hash(conn):
    led = _older_harvests_ledger(conn, "so2")
    assert check_ledger(conn, "so2").ok
    assert led.states_and_owners([A, C, D]) == (["s", "s", "q"], ["spool1", None, None])
    records = PackingRecords(conn, "so2")
    assert records.put_owned("rec", PackingRecord("shard1", [A, B], "spool1"), "lid")[1] is True
    assert records.put_owned("rec2", PackingRecord("shard2", [A, B], "spool2"), "lid")[1] is False
    assert led.owned_by("spool1") == [A, B]
    assert led.mark_done([A]) == [A]
    assert led.reclaim("spool1", [B]) == [B]
    assert led.mark_failed({C: ("bad-dump", "x")}) == [C]
    assert conn.exists(led.keys.spool_owner) == 0 and conn.exists(led.keys.spool_counts) == 0
    assert led.mark_spooled([B], owner="spool3") == [B]  # spooled again, by this harvest
    assert _raw(conn, led, A, B) == [b"d", b"s:spool3"]
    assert conn.hgetall(led.keys.spool_counts) == {b"spool3": b"1"}
    assert check_ledger(conn, "so2").ok


def test_the_ledger_check_names_owners_that_disagree_with_the_state_values_and_repairs_them(conn):
    led = _older_harvests_ledger(conn, "so3")
    k = led.keys
    conn.hset(k.state, mapping={A: "s:spool1", B: "s:spool1"})  # fused, with the old entries left behind
    conn.hdel(k.spool_owner, C)  # a bare `s` with no owner anywhere
    rep = check_ledger(conn, "so3")
    assert rep.problems == [f"owner without spooled: 2 (e.g. {A}, {B})", f"spooled without owner: 1 (e.g. {C})"]
    check_ledger(conn, "so3", repair=True)
    assert conn.exists(k.spool_owner) == 0 and _raw(conn, led, C) == [b"s:"]
    assert led.states_and_owners([A, C]) == (["s", "s"], ["spool1", None])
    assert check_ledger(conn, "so3").ok


def test_the_ledger_check_counts_each_spools_samples_from_the_owners_in_the_state_values(conn):
    led = Ledger(conn, "so4")
    led.add_queued([A, B, C])
    led.mark_spooled([A, B], owner="spool1")
    led.mark_spooled([C], owner="spool2")
    conn.hset(led.keys.spool_counts, mapping={"spool1": 5, "spool9": 1})
    rep = check_ledger(conn, "so4", repair=True)
    assert rep.problems == [
        "spool spool1: its counter says 5 spooled samples, the state hash 2",
        "spool spool9: its counter says 1 spooled samples, the state hash 0",
    ]
    assert conn.hgetall(led.keys.spool_counts) == {b"spool1": b"2", b"spool2": b"1"}
