"""Defaults in one place (issue 25): each tunable's default literal is written once, in
`harvest/settings.py`; every option, signature and constant elsewhere reads it from there.

The source is read with ast, as tests/unit/test_house.py reads it: a default is a numeric
constant expression (`120.0`, `64 << 30`) bound to a name that says what it is: a parameter's
or field's default, a keyword argument, an assignment, or a click option's `default=` (named by
its flag, `--max-spool-mb` -> `max_spool_mb`)."""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

from harvest.settings import CollectorSettings, ProducerSettings, RunnerSettings, RunTunables, WorkerSettings
from tests.support.cli import REPO

PACKAGES = ("harvest", "producer", "workers", "collector", "engines")
SETTINGS = os.path.join("harvest", "settings.py")

# label -> (fragments of the names it goes by, the values it is written as: bytes and MiB alike)
DEFAULTS = {
    "spool grace": (("spool_grace",), {RunTunables.spool_grace_s}),
    "max queued": (("max_queued",), {ProducerSettings.max_queued}),
    "dump timeout": (("dump_timeout",), {WorkerSettings.dump_timeout_s}),
    "spool cap": (("max_spool",), {WorkerSettings.max_spool_bytes, WorkerSettings.max_spool_bytes >> 20}),
    "shard size": (("shard_bytes", "shard_mb"), {RunTunables.shard_bytes, RunTunables.shard_bytes >> 20}),
    "batch samples": (("batch_samples",), {RunTunables.max_batch_samples}),
    "batch tokens": (("batch_tokens",), {RunTunables.max_batch_tokens}),
    "run's max wait": (("max_wait",), {RunnerSettings.max_wait_s}),
    "collector's max wait": (("max_wait",), {CollectorSettings.max_wait_s}),
    "part size": (("part_bytes", "part_mb"), {CollectorSettings.part_bytes, CollectorSettings.part_bytes >> 20}),
    "retry backoff": (("retry_backoff",), {WorkerSettings.retry_backoff_s}),
    "orphan age": (("orphan_age",), {CollectorSettings.orphan_age_s}),
}
# Copies this change could not touch (label, folder, name): the job context's own field defaults
# (workers.job's WorkerContext, moving to workers.context), which `run_worker` always sets from
# WorkerSettings. Each goes when its file reads harvest.settings; the test fails once one is gone,
# so the list only shrinks.
PENDING = {
    ("dump timeout", "workers", "dump_timeout"),
    ("spool cap", "workers", "max_spool_bytes"),
}


def _source_files() -> list[str]:
    out = []
    for top in PACKAGES:
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.relpath(os.path.join(d, n), REPO) for n in names if n.endswith(".py")]
    return sorted(out)


def _number(node: ast.AST) -> float | None:
    """The value of a numeric constant expression (`60.0`, `64 << 30`, `6 * 3600.0`), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _number(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = _number(node.left), _number(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.LShift):
            return a << b if isinstance(a, int) and isinstance(b, int) else None
        ops = {ast.Mult: lambda: a * b, ast.Add: lambda: a + b, ast.Pow: lambda: a**b}
        return ops[type(node.op)]() if type(node.op) in ops else None
    return None


def _flag_name(call: ast.Call) -> str:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return " ".join(f.lstrip("-").replace("-", "_") for f in flags)


def _bindings(path: str) -> list[tuple[str, float, int]]:
    """(name, value, line) of every numeric constant bound to a name in `path`."""
    tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
    out = []

    def bind(name: str | None, value: ast.AST | None) -> None:
        v = None if value is None else _number(value)
        if name and v is not None:
            out.append((name.lower(), v, value.lineno))

    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                bind(arg.arg, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                bind(arg.arg, default)
        elif isinstance(n, ast.Call):
            for kw in n.keywords:
                bind(_flag_name(n) if kw.arg == "default" else kw.arg, kw.value)
        elif isinstance(n, ast.AnnAssign):
            bind(getattr(n.target, "id", None) or getattr(n.target, "attr", None), n.value)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                bind(getattr(t, "id", None) or getattr(t, "attr", None), n.value)
    return out


def _holders() -> dict[str, list[tuple[str, int, str]]]:
    """label -> (file, line, name) of each place its literal is written."""
    found = defaultdict(list)
    for f in _source_files():
        for name, value, line in _bindings(f):
            for label, (fragments, values) in DEFAULTS.items():
                if value in values and any(frag in name for frag in fragments):
                    found[label].append((f, line, name))
    return found


def _pending(label: str, f: str, name: str) -> bool:
    return (label, f.split(os.sep)[0], name) in PENDING


def test_each_default_is_written_once_in_the_settings_module():
    found = _holders()
    elsewhere = {label: sorted(f"{f}:{line}" for f, line, name in where
                               if f != SETTINGS and not _pending(label, f, name))
                 for label, where in found.items()}
    assert {label: w for label, w in elsewhere.items() if w} == {}
    in_settings = {label: sum(f == SETTINGS for f, _, _ in found.get(label, [])) for label in DEFAULTS}
    assert in_settings == {label: 1 for label in DEFAULTS}


def test_pending_copies_are_still_there():
    found = _holders()
    seen = {(label, f.split(os.sep)[0], name) for label, where in found.items() for f, _, name in where}
    assert sorted(PENDING - seen) == [], "these copies are gone: take them out of PENDING"


def test_the_scan_sees_the_usual_spellings(tmp_path, monkeypatch):
    """The scanner finds a copy however it is spelled, so the tests above can fail."""
    src = tmp_path / "harvest"
    src.mkdir()
    (src / "copy.py").write_text(
        "import click\n"
        "DEFAULT_MAX_QUEUED = 20000\n"
        "def f(spool_grace_s: float = 120.0, *, max_spool_bytes=64 << 30): ...\n"
        "opt = click.option('--max-spool-mb', default=64 << 10)\n"
        "g(dump_timeout=60.0)\n"
        "class C:\n    shard_bytes: int = 1 << 30\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    got = {(name, v) for name, v, _ in _bindings(os.path.join("harvest", "copy.py"))}
    assert got >= {("default_max_queued", 20000), ("spool_grace_s", 120.0), ("max_spool_bytes", 64 << 30),
                   ("max_spool_mb", 64 << 10), ("dump_timeout", 60.0), ("shard_bytes", 1 << 30)}
