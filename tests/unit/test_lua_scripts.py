"""Harvest's Lua scripts as files (harvest/state/lua, loaded by harvest.state.scripts): every file
loads and compiles (in Redis, and in Lua 5.1's own compiler, Redis's Lua), every include
resolves, no script or shared piece reads a name it does not define or take as an argument
(another script's locals included), and every wrapper's KEYS and ARGV counts match its script's
header."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import redis

from harvest.state import scripts
from harvest.state.keys import Keys
from harvest.state.scripts import LUA_DIR, Segment
from tests.support.need import need

# What Redis's Lua gives every script; KEYS and ARGV are the script's own, never a shared piece's.
BUILTINS = {
    "redis",
    "cjson",
    "string",
    "math",
    "table",
    "tonumber",
    "tostring",
    "type",
    "pairs",
    "ipairs",
    "next",
    "unpack",
    "pcall",
    "error",
    "select",
    "assert",
}
K = Keys("lua")


def lua_files(under: str = "") -> list[str]:
    return sorted(str(p.relative_to(LUA_DIR)) for p in (LUA_DIR / under).glob("*.lua"))


def luac_globals(text: str, tmp_path) -> set[str]:
    """The global names `text` reads or writes, by Lua 5.1's compiler's listing (`luac -l`)."""
    luac = shutil.which("luac5.1") or shutil.which("luac")
    if luac is None:
        need("luac5.1", "the static check of the Lua scripts' names needs Lua 5.1's compiler (apt: lua5.1)")
    path = tmp_path / "chunk.lua"
    path.write_text(text)
    out = subprocess.run([luac, "-p", "-l", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"[GS]ETGLOBAL\s.*?;\s*(\S+)", out.stdout))


def test_every_file_is_a_script_or_a_piece_a_script_includes():
    names = {f"{lua.name}.lua" for lua in scripts.ALL}
    assert set(lua_files()) == names
    included = set()
    for name in names:
        included |= set(re.findall(r"^--! include (\S+)", (LUA_DIR / name).read_text(), re.M))
    for lib in lua_files("lib"):
        included |= set(re.findall(r"^--! include (\S+)", (LUA_DIR / lib).read_text(), re.M))
    assert included == set(lua_files("lib"))


def test_every_include_resolves_and_goes_in_once(tmp_path, monkeypatch):
    for lua in scripts.ALL:
        assert "--! include" not in lua.text
        # each shared function defined once, though pieces include the same piece
        defined = re.findall(r"^local function (\w+)", lua.text, re.M)
        assert len(defined) == len(set(defined)), lua.name
    (tmp_path / "lib").mkdir()
    (tmp_path / "a.lua").write_text("-- KEYS[1] = k\n--! include lib/x.lua\n--! include lib/y.lua\nreturn f()\n")
    (tmp_path / "lib" / "x.lua").write_text("--! include lib/y.lua\nlocal function f() return g() end\n")
    (tmp_path / "lib" / "y.lua").write_text("-- g: one\nlocal function g() return 1 end\n")
    monkeypatch.setattr(scripts, "LUA_DIR", tmp_path)
    assert scripts.source("a.lua") == "local function g() return 1 end\nlocal function f() return g() end\nreturn f()\n"
    (tmp_path / "b.lua").write_text("--! include lib/missing.lua\nreturn 1\n")
    with pytest.raises(FileNotFoundError):
        scripts.source("b.lua")


def test_every_script_compiles_in_redis(conn):
    for lua in scripts.ALL:
        assert conn.script_load(lua.text) == lua.script.sha


def test_no_script_reads_a_name_it_does_not_define(tmp_path):
    """Each script, its pieces included, reads only Redis's builtins, KEYS and ARGV as globals: a
    name a piece took from another script's locals would be a global here, nil in Redis."""
    for lua in scripts.ALL:
        assert luac_globals(lua.text, tmp_path) <= BUILTINS | {"KEYS", "ARGV"}, lua.name


def test_every_shared_piece_takes_its_inputs_as_arguments(tmp_path):
    """A piece of lib/, with only its own includes, compiles alone, reads no KEYS or ARGV, and
    holds no state of its own at its top: only functions and constants."""
    for lib in lua_files("lib"):
        text = scripts.source(lib)
        assert luac_globals(text, tmp_path) <= BUILTINS, lib
        own = (LUA_DIR / lib).read_text()
        for line in own.splitlines():
            if line.startswith("local "):
                assert re.match(r"local (function \w+\(|[A-Z_]+ = \d+ )", line), (lib, line)


def header_counts(lua: scripts.Lua) -> None:
    """The header's counts agree with the KEYS[i] and ARGV[i] the script's own text names."""
    own = (LUA_DIR / f"{lua.name}.lua").read_text()
    body = "\n".join(line for line in own.splitlines() if not line.startswith("--"))
    for arity, what in ((lua.keys, "KEYS"), (lua.args, "ARGV")):
        named = [int(i) for i in re.findall(rf"{what}\[(\d+)\]", body)]
        named += [int(at) + 9 for at in re.findall(rf"move_keys\({what}, (\d+)\)", body)]  # the 10 move keys
        top = max(named, default=0)
        if arity.more:  # every fixed one named; the open tail is read by index or by its length
            assert top >= arity.least, (lua.name, what, top, arity)
        else:
            assert top == arity.least, (lua.name, what, top, arity)


def test_every_header_names_what_its_script_reads():
    for lua in scripts.ALL:
        header_counts(lua)


def test_a_call_whose_counts_do_not_match_the_header_is_refused():
    with pytest.raises(ValueError, match=r"release_lock.lua takes .* not 1 and 1"):
        scripts.RELEASE_LOCK.call(["lock"], ["token"])
    with pytest.raises(ValueError, match="forget.lua"):
        scripts.FORGET.call([K.state], ["d"])


def wrapper_calls() -> dict[str, scripts.ScriptCall]:
    """One call of every wrapper, by its script's name."""
    seg = Segment("d", "_qsf", False, "samples_done", "", "", ["a", "b"], [], [])
    return {
        "transition": scripts.transition(K, "q", "_", ["a", "b"], ["", ""], ["r1", "r2"]),
        "add_queued": scripts.add_queued(K, ["c"]),
        "forget": scripts.forget(K, "q", ["c"]),
        "settle": scripts.settle(K, [seg], {"shards": 1}, clear=(K.packing("n"), K.packing_index)),
        "stats": scripts.add_stats(K, {"x": 1}, {"job_seconds": scripts.Histogram({"1.0": 2}, 2, 0.5)}),
        "reclaim": scripts.reclaim(K, "sp", ["a"]),
        "fence": scripts.fence(K, "sp", ["a"], K.packing("n"), "{}", ""),
        "put_record": scripts.put_record(K, K.packing("n"), "{}", "sp", ["a"], "id1"),
        "forget_record_if_gone": scripts.forget_record_if_gone(K, K.packing("m")),
        "delete_record_if_same": scripts.delete_record_if_same(K, K.packing("n"), "{}"),
        "renew_spool": scripts.renew_spool(K, "sp", "node"),
        "heartbeat": scripts.heartbeat("harvest:worker:w", 15, "seen", {"state": "idle"}, (K.workers, "w")),
        "job_ended": scripts.job_ended("harvest:worker:w", 15, {"state": "idle"}),
        "check_ledger": scripts.check_ledger(K, False, "{}", []),
        "release_lock": scripts.release_lock(K.janitor_lock, "token"),
        "hold_reaping": scripts.hold_reaping(K, 1.0),
        "put_back": scripts.put_back("rq:queue:lua:intermediate", "rq:queue:lua", "rq:job:j", "j"),
    }


def test_every_wrapper_builds_a_call_its_script_runs(conn):
    """One wrapper a script (each built call is checked against the header as it is built), and
    each runs on a real Redis, in a transaction too."""
    calls = wrapper_calls()
    assert set(calls) == {lua.name for lua in scripts.ALL}
    for _name, call in calls.items():
        call.run(conn)
    with conn.pipeline(transaction=True) as pipe:
        for call in calls.values():
            call.queue(pipe)
        replies = pipe.execute(raise_on_error=False)
    assert not [r for r in replies if isinstance(r, redis.ResponseError)]
    assert conn.hget(K.state, "a") == b"d" and conn.hget(K.stats, "x") == b"2"  # written by the calls, twice
