"""The house rules of the source tree, read from the code itself (docs/architecture.md, "House
rules"): which folder may import which, no import cycles, no file over 400 lines, and each
contract's names in exactly one module."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

from harvest.state.failures import REASONS
from tests.support.cli import REPO

WINGS = ("producer", "workers", "collector", "engines")
PACKAGES = ("harvest", *WINGS)
ROOT = "harvest.cli"  # the composition root: the only core code that imports the wings
MAX_LINES = 400


def _py_files() -> list[str]:
    out = []
    for top in (*PACKAGES, "tests", "bench", "scripts"):
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.relpath(os.path.join(d, n), REPO) for n in names if n.endswith(".py")]
    return sorted(out)


def _module(path: str) -> str:
    mod = path[:-3].replace(os.sep, ".")
    return mod.removesuffix(".__init__")


def _first_party(name: str) -> bool:
    return name.split(".")[0] in (*PACKAGES, "tests")


def _imports(path: str) -> set[str]:
    """First-party modules `path` imports (at module level or inside functions)."""
    tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _first_party(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _first_party(node.module):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = [f for f in _py_files() if f.split(os.sep)[0] in PACKAGES]
    mods = {_module(f): f for f in files}
    return {m: {i for i in _imports(f) if i in mods and i != m} for m, f in mods.items()}


def _literals(path: str) -> list[str]:
    """Every string constant in `path` except docstrings, f-string pieces included."""
    tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def _source_files() -> list[str]:
    return [f for f in _py_files() if f.split(os.sep)[0] in PACKAGES]


def _holders(match) -> set[str]:
    return {f for f in _source_files() if any(match(s) for s in _literals(f))}


def test_no_file_over_400_lines():
    long = {f: n for f in _py_files() if (n := sum(1 for _ in open(os.path.join(REPO, f)))) > MAX_LINES}
    assert long == {}


def test_wings_import_only_the_core(graph):
    bad = []
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if top in WINGS and other in WINGS and other != top:
                bad.append(f"{mod} -> {dep}")
            if top == "harvest" and not mod.startswith(ROOT) and other in WINGS:
                bad.append(f"{mod} -> {dep}")
    assert bad == []


def test_no_import_cycles(graph):
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in seen:
                visit(d, path + [d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert cycles == []


def test_bench_imports_only_the_package_and_test_support():
    bad = {f: sorted(i for i in _imports(f) if i.startswith("tests.") and not i.startswith("tests.support"))
           for f in _py_files() if f.startswith(("bench", "scripts"))}
    assert {f: v for f, v in bad.items() if v} == {}


def test_each_failure_reason_is_named_in_one_module():
    holders = defaultdict(set)
    for f in _source_files():
        for s in _literals(f):
            if s in REASONS:
                holders[s].add(f)
    assert dict(holders) == {r: {os.path.join("harvest", "state", "failures.py")} for r in REASONS}


def test_redis_key_patterns_live_in_the_keys_module():
    # harvest's keys start `harvest:<...>`, RQ's `rq:<...>`; log and error text has a space after the colon
    def is_key(s: str) -> bool:
        return s.startswith(("harvest:", "rq:")) and not s[len(s.split(":")[0]) + 1:].startswith(" ")

    assert _holders(is_key) == {os.path.join("harvest", "state", "keys.py")}


def test_rq_job_options_live_in_the_job_contract():
    jobs = os.path.join("harvest", "state", "jobs.py")
    uses = defaultdict(set)
    for f in _source_files():
        tree = ast.parse(open(os.path.join(REPO, f)).read(), f)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                attr = n.func.attr if isinstance(n.func, ast.Attribute) else None
                name = attr or getattr(n.func, "id", "")
                rq_queue = isinstance(n.func, ast.Name) and n.func.id == "Queue"  # not the stdlib's queue.Queue
                options = any(k.arg in ("failure_ttl", "result_ttl", "job_timeout") for k in n.keywords)
                # a serializer other than the contract's own SERIALIZER
                own = [k for k in n.keywords if k.arg == "serializer" and not (
                    getattr(k.value, "id", None) == "SERIALIZER" or getattr(k.value, "attr", None) == "SERIALIZER")]
                if rq_queue or attr in ("enqueue_call", "enqueue") or options or own:
                    uses[name].add(f)
            if isinstance(n, ast.Name) and n.id == "JSONSerializer":
                uses["JSONSerializer"].add(f)
    assert {k: v for k, v in uses.items() if v != {jobs}} == {}


def test_dump_dir_names_live_in_the_dump_dir_module():
    dumpdir = os.path.join("harvest", "node", "dumpdir.py")
    assert _holders(lambda s: s in (".claimed-", ".vllm") or s.startswith((".claimed-", ".vllm/"))) == {dumpdir}
    # `.tmp-` also names files in flight in output folders (harvest.storage), which are not the dump dir
    assert _holders(lambda s: s.startswith(".tmp-")) == {dumpdir, os.path.join("harvest", "storage.py")}
