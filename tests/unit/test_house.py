"""The house rules of the source tree, read from the code itself (docs/architecture.md, "House
rules"): which folder may import which, no import cycles, each contract's names in exactly one
module, every error under one root, each default written once, and `harvest.read` importable
with no Redis client installed. The ast readers are
tests/support/house.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict

import pytest

import harvest.read
from harvest.errors import KINDS
from harvest.settings import (
    CollectorSettings,
    EngineSettings,
    IdentityDefaults,
    MetricsSettings,
    ProducerSettings,
    RedisSettings,
    RunnerSettings,
    RunTunables,
    StorageSettings,
    WorkerSettings,
)
from harvest.state.failures import REASONS
from tests.support import house
from tests.support.house import (
    PACKAGES,
    REPO,
    WINGS,
    ancestors,
    bindings,
    classes,
    holders,
    imports,
    in_root,
    is_exception,
    literals,
    module_name,
    package_of,
    py_files,
    read,
    source_files,
)

ROOT = "harvest.cli"  # the composition root: the only core code that imports the wings


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = [f for f in py_files() if f.split(os.sep)[0] in PACKAGES]
    mods = {module_name(f): f for f in files}
    return {m: {i for i in imports(f) if i in mods and i != m} for m, f in mods.items()}


def test_wings_import_only_the_core(graph):
    bad = []
    for mod, deps in graph.items():
        top = package_of(mod)
        for dep in deps:
            other = package_of(dep)
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
                cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
            elif d not in seen:
                visit(d, path + [d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert cycles == []


def test_bench_imports_only_the_package_and_test_support():
    bad = {
        f: sorted(i for i in imports(f) if i.startswith("tests.") and not i.startswith("tests.support"))
        for f in py_files()
        if f.startswith(("bench", "scripts"))
    }
    assert {f: v for f, v in bad.items() if v} == {}


def test_each_failure_reason_is_named_in_one_module():
    holders = defaultdict(set)
    for f in source_files():
        for s in literals(f):
            if s in REASONS:
                holders[s].add(f)
    assert dict(holders) == {r: {os.path.join("harvest", "state", "failures.py")} for r in REASONS}


def test_redis_key_patterns_live_in_the_keys_module():
    # harvest's keys start `harvest:<...>`, RQ's `rq:<...>`; log and error text has a space after the colon
    def is_key(s: str) -> bool:
        return s.startswith(("harvest:", "rq:")) and not s[len(s.split(":")[0]) + 1 :].startswith(" ")

    assert holders(is_key) == {os.path.join("harvest", "state", "keys.py")}


def test_rq_job_options_live_in_the_job_contract():
    jobs = os.path.join("harvest", "state", "jobs.py")
    uses = defaultdict(set)
    for f in source_files():
        tree = ast.parse(read(f), f)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                attr = n.func.attr if isinstance(n.func, ast.Attribute) else None
                name = attr or getattr(n.func, "id", "")
                rq_queue = isinstance(n.func, ast.Name) and n.func.id == "Queue"  # not the stdlib's queue.Queue
                options = any(k.arg in ("failure_ttl", "result_ttl", "job_timeout") for k in n.keywords)
                # a serializer other than the contract's own SERIALIZER
                own = [
                    k
                    for k in n.keywords
                    if k.arg == "serializer"
                    and not (
                        getattr(k.value, "id", None) == "SERIALIZER" or getattr(k.value, "attr", None) == "SERIALIZER"
                    )
                ]
                if rq_queue or attr in ("enqueue_call", "enqueue") or options or own:
                    uses[name].add(f)
            if isinstance(n, ast.Name) and n.id == "JSONSerializer":
                uses["JSONSerializer"].add(f)
    assert {k: v for k, v in uses.items() if v != {jobs}} == {}


def test_dump_dir_names_live_in_the_dump_dir_module():
    dumpdir = os.path.join("harvest", "node", "dumpdir.py")
    assert holders(lambda s: s in (".claimed-", ".vllm") or s.startswith((".claimed-", ".vllm/"))) == {dumpdir}
    # `.tmp-` also names files in flight in output folders (harvest.storage), which are not the dump dir
    assert holders(lambda s: s.startswith(".tmp-")) == {dumpdir, os.path.join("harvest", "storage.py")}


# -- one atomic local write -----------------------------------------------------------------------

ATOMIC = os.path.join("harvest", "atomic.py")

# os.replace / os.rename outside harvest.atomic, "path:function" -> why it is not a hand-written
# temp-and-rename writer.
RENAMES = {
    "harvest/node/spooldir.py:SpoolBatch.commit": "a job's spool files made durable together (one syncfs), then "
    "renamed in with one fsync of the dir, not one fsync each",
    "harvest/storage.py:Location.delete_if": "the rename takes the file to compare it: the local delete's protocol",
    "harvest/storage.py:Location.put_file": "commits a shard file its writer completed in the folder: consumed, "
    "not written",
    "workers/claim.py:claim": "the rename is the claim: the worker that moves a dump file first owns it",
    "collector/integrity.py:reject": "moves an existing bad spool file aside for a person",
}


def _renames(path: str) -> list[str]:
    """ "path:function" of each os.replace / os.rename call in `path` (or of the module, at its top),
    and of each `from os import` of them."""
    out = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            f = getattr(child, "func", None)
            if (
                isinstance(child, ast.Call)
                and isinstance(f, ast.Attribute)
                and getattr(f.value, "id", None) == "os"
                and f.attr in ("replace", "rename", "renames")
            ):
                out.append(f"{path}:{where or '<module>'}")
            if (
                isinstance(child, ast.ImportFrom)
                and child.module == "os"
                and {a.name for a in child.names} & {"replace", "rename", "renames"}
            ):
                out.append(f"{path}:{where or '<module>'}")
            visit(child, where)

    visit(ast.parse(read(path), path), "")
    return out


def test_local_files_are_written_through_harvest_atomic():
    found = {r for f in source_files() if f != ATOMIC for r in _renames(f)}
    unexplained = sorted(found - set(RENAMES))
    assert not unexplained, (
        f"{unexplained}: write the file with harvest.atomic (write_atomic, atomic_path, "
        "atomic_folder), or list the rename in RENAMES with why it is not a writer's"
    )
    assert sorted(set(RENAMES) - found) == [], "gone: remove them from RENAMES"


# -- one error root ------------------------------------------------------------------------------

# Exception classes outside the root, "path:Class" -> why.
OUTSIDE = {
    "harvest/state/failures.py:SampleFailure": "one sample's failure with its reason: recorded in the ledger by the "
    "worker, never raised to the CLI",
    "collector/records.py:Voided": "the commit fence refused a shard: the collector drops it",
    "collector/integrity.py:Damaged": "a spool file found damaged while packing: the collector voids the shard",
    "workers/safejob.py:RefusedJob": "raised inside RQ's job execution; RQ fails that job, the worker goes on",
    "harvest/formats/filecopy.py:ShortFile": "a kernel copy met the end of its source: the shard writer falls back",
    "engines/reference.py:BadRequest": "answered as HTTP 400 by the reference engine's handler",
    "workers/regenerate.py:_Stopped": "a conversation left between turns once its job's generation step failed: "
    "dropped there, the step's own error is what is raised",
}


@pytest.fixture(scope="module")
def class_tree() -> dict[str, tuple[str, list[str]]]:
    return classes()


def test_every_exception_class_derives_from_harvest_error(class_tree):
    exceptions = {k for k in class_tree if is_exception(k, class_tree)}
    assert "harvest/errors.py:HarvestError" in exceptions and len(exceptions) > 25
    outside = sorted(k for k in exceptions - {"harvest/errors.py:HarvestError"} if not in_root(k, class_tree))
    unexplained = [k for k in outside if k not in OUTSIDE]
    assert not unexplained, (
        f"{unexplained}: derive each from its kind in harvest/errors.py (keeping the built-in "
        "base its callers catch), or list it in OUTSIDE with why it never reaches the CLI"
    )
    missing = [k for k in OUTSIDE if k not in class_tree]
    assert not missing, f"{missing}: gone; remove them from OUTSIDE"
    stale = [k for k in OUTSIDE if in_root(k, class_tree) and not OUTSIDE[k].startswith("pending:")]
    assert not stale, f"{stale}: in the root now; remove them from OUTSIDE"


def test_every_error_has_one_of_the_kinds(class_tree):
    kinds = {f"harvest/errors.py:{k.__name__}" for k in KINDS}
    for key in class_tree:
        if in_root(key, class_tree) and key not in kinds:
            assert ancestors(key, class_tree) & kinds, f"{key} derives from HarvestError itself: choose its kind"


# -- every default once ---------------------------------------------------------------------------

SETTINGS = os.path.join("harvest", "settings.py")

# label -> (fragments of the names it goes by, the values it is written as: bytes and MiB alike)
# A default is a parameter's, a field's, a click option's `default=`, or a value a name is given.
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
    "layers": (("layers",), {IdentityDefaults.layers}),
    "storage dtype": (("dtype",), {IdentityDefaults.storage_dtype}),
    "engine kind": (("engine",), {IdentityDefaults.engine}),
    "overlong": (("overlong",), {ProducerSettings.overlong}),
    "tokenizer processes": (("processes",), {ProducerSettings.processes}),
    "engine port": (("port",), {EngineSettings.port}),
    "vllm port": (("port",), {EngineSettings.vllm_port}),
    "reference chunk": (("chunked_prefill",), {EngineSettings.chunked_prefill_size}),
    "sglang chunk": (("chunked_prefill",), {EngineSettings.sglang_chunked_prefill_size}),
    "tensor parallel": (("tp_size",), {EngineSettings.tp_size}),
    "sglang version": (("version",), {EngineSettings.sglang_version}),
    "sglang device": (("device",), {EngineSettings.device}),
    "engine dtype": (("dtype",), {EngineSettings.dtype}),
    "vllm kv cache": (("kvcache",), {EngineSettings.vllm_kvcache_gib}),
    "storage attempts": (("attempts", "storage_retries"), {StorageSettings.attempts}),
    "storage retry delay": (("retry_delay", "base_delay"), {StorageSettings.retry_delay_s}),
    "storage max delay": (("max_delay", "max_retry_delay"), {StorageSettings.max_retry_delay_s}),
    "redis outage": (("outage",), {RedisSettings.outage_s}),
    "metrics port": (("port",), {MetricsSettings.port}),
}
# "path:label" -> why a file still writes its own copy of a default (until its owner's edit lands).
PENDING: dict[str, str] = {}  # "path:label" -> why that copy stays for now (none left)


def _default_holders() -> dict[str, list[tuple[str, int, str]]]:
    """label -> (file, line, name) of each place its literal is written."""
    found = defaultdict(list)
    for f in source_files():
        for name, value, line in bindings(f):
            for label, (fragments, values) in DEFAULTS.items():
                if value in values and any(frag in name for frag in fragments):
                    found[label].append((f, line, name))
    return found


def test_each_default_is_written_once_in_the_settings_module():
    found = _default_holders()
    elsewhere = {
        label: sorted(f"{f}:{line}" for f, line, _ in where if f != SETTINGS and f"{f}:{label}" not in PENDING)
        for label, where in found.items()
    }
    assert {label: w for label, w in elsewhere.items() if w} == {}
    landed = [k for k in PENDING if k not in {f"{f}:{label}" for label, where in found.items() for f, _, _ in where}]
    assert not landed, f"{landed}: read from harvest.settings now; remove them from PENDING"
    in_settings = {label: sum(f == SETTINGS for f, _, _ in found.get(label, [])) for label in DEFAULTS}
    assert in_settings == {label: 1 for label in DEFAULTS}


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
        "layers_option = click.option('--layers', default='eagle3', show_default=True)\n"
        "def h(engine: str = 'reference'): ...\n"
        "class D:\n    storage_dtype: str = 'bf16'\n"
    )
    monkeypatch.setattr(house, "REPO", str(tmp_path))
    got = {(name, v) for name, v, _ in bindings(os.path.join("harvest", "copy.py"))}
    assert got >= {
        ("default_max_queued", 20000),
        ("spool_grace_s", 120.0),
        ("max_spool_bytes", 64 << 30),
        ("max_spool_mb", 64 << 10),
        ("dump_timeout", 60.0),
        ("shard_bytes", 1 << 30),
        ("layers", "eagle3"),
        ("engine", "reference"),
        ("storage_dtype", "bf16"),
    }


# -- reading a run needs no Redis ------------------------------------------------------------------


def test_harvest_read_imports_and_resolves_its_api_with_redis_and_rq_blocked():
    # A trainer's machine has the output folder and harvest, maybe no Redis client at all
    # (tests/unit/test_read_api.py reads a whole run that way).
    code = (
        "import sys\n"
        "class Blocked:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('redis', 'rq'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, Blocked())\n"
        "import harvest.read as hr\n"
        "[getattr(hr, n) for n in hr.__all__]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'rq')), len(hr.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", str(len(harvest.read.__all__))]
