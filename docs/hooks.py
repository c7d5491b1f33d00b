"""mkdocs hook: the reference pages that are read from the code at build time, so they cannot drift.

A page holds a marker line `<!-- generated: NAME -->`; `on_page_markdown` replaces it with the table
`GENERATORS[NAME]` builds from the source tree:

- `settings`: every settings class of harvest/settings.py with each field, its default and its comment;
- `environment`: every environment variable the code reads (`os.environ`, `os.getenv`, `*_ENV = "..."`
  constants), with the modules that read it;
- `metrics`: every metric family harvest/ops/metrics.py defines, with its type, labels and help.

`on_page_content` tidies the generated command-line reference (no default shown as click's marker).

The hook imports nothing but harvest.settings and harvest.ops.metrics's two tables (and parses the
rest), so the build needs no Redis and no torch.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("harvest", "producer", "workers", "collector", "engines")
MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.M)

# What each environment variable is for; a variable the code reads and this table lacks still gets
# its row (with the modules that read it), so the page lists every one.
ENV_PURPOSE = {
    "HARVEST_REDIS_URL": "Redis URL of every command without `--redis` (default `redis://127.0.0.1:6379/0`).",
    "HARVEST_REDIS_OUTAGE_S": "Seconds a service waits for a Redis that went away before it exits 75.",
    "HARVEST_S3_ENDPOINT": "S3-compatible endpoint (MinIO, Ceph, moto); `--s3-endpoint` overrides.",
    "HARVEST_S3_REGION": "S3 region for `s3://` outputs.",
    "HARVEST_WORK": "Parent of `harvest run`'s default work dir (`$HARVEST_WORK/<run>`).",
    "HARVEST_CACHE": "harvest's cache folder (the engine venvs, the work dirs; default `~/.cache/harvest`).",
    "HARVEST_DUMP_DIR": "SGLang plugin: the dump dir the engine writes its hidden-state chunks to.",
    "HARVEST_CAPTURE": "SGLang plugin: the capture points, comma separated (printed by `harvest sglang-args`).",
    "HARVEST_MODEL_NAME": "SGLang plugin: the model's name in its dump files.",
    "HARVEST_MODEL_FINGERPRINT": "SGLang plugin: the run's model fingerprint, checked at load.",
    "HARVEST_MODEL_DIR": "vLLM runs: the checkpoint folder a worker reads the final norm from.",
    "HARVEST_SGLANG_VENV": "Where `scripts/sglang_venv.sh` builds SGLang's CPU venv.",
    "HARVEST_VLLM_VENV": "Where `scripts/vllm_venv.sh` builds vLLM's CPU venv.",
    "HARVEST_ENGINE_FAULTS": "Test only: faults the reference engine injects.",
    "HARVEST_ENGINE_HANG_S": "Test only: the reference engine's `hang` fault, in seconds.",
    "HARVEST_COLLECTOR_CRASH_AT": "Test only: the collector crash harness's crash point.",
    "AWS_ACCESS_KEY_ID": "S3 credentials (or `AWS_PROFILE`).",
    "AWS_SECRET_ACCESS_KEY": "S3 credentials (or `AWS_PROFILE`).",
    "AWS_SESSION_TOKEN": "S3 credentials: a temporary session's token.",
}

_ENV_READ = re.compile(
    r"""(?:environ\.get\(|environ\[|getenv\(|environ\.setdefault\(|\w*ENV\w*\s*=\s*)["']([A-Z][A-Z0-9_]+)["']"""
)


def _python_files():
    for top in SOURCES:
        yield from sorted((ROOT / top).rglob("*.py"))


def environment() -> str:
    """Every environment variable the code reads, with the modules that read it."""
    readers: dict[str, set[str]] = {}
    for path in _python_files():
        for name in _ENV_READ.findall(path.read_text()):
            if name.startswith(("HARVEST_", "AWS_")):
                readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for name in ENV_PURPOSE:  # named by the table but read in a way the pattern misses (e.g. a prefix)
        if name not in readers:
            hits = {str(p.relative_to(ROOT)) for p in _python_files() if name in p.read_text()}
            if hits:
                readers[name] = hits
    rows = ["| variable | what it sets | read in |", "|---|---|---|"]
    for name in sorted(readers):
        where = ", ".join(f"`{w}`" for w in sorted(readers[name]))
        rows.append(f"| `{name}` | {ENV_PURPOSE.get(name, '')} | {where} |")
    return "\n".join(rows)


def _field_comments(cls_node: ast.ClassDef, lines: list[str]) -> dict[str, str]:
    """Each field's comment: the end of its line, else the comment lines just above it."""
    out = {}
    for stmt in cls_node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            line = lines[stmt.lineno - 1]
            comment = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            if not comment:
                above, i = [], stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                comment = " ".join(above)
            out[stmt.target.id] = comment
    return out


def _default(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        mib = value >> 20
        return f"{value} ({mib >> 10} GiB)" if mib % 1024 == 0 else f"{value} ({mib} MiB)"
    return repr(value)


def settings() -> str:
    """Every settings class with its fields, defaults and comments."""
    sys.path.insert(0, str(ROOT))
    module = importlib.import_module("harvest.settings")
    source = (ROOT / "harvest" / "settings.py").read_text()
    lines = source.splitlines()
    parts = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name)
        comments = _field_comments(node, lines)
        doc = " ".join((ast.get_docstring(node) or "").split())
        parts += [f"### `{node.name}`", "", doc, "", "| setting | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            text = comments.get(f.name, "").replace("|", "\\|")
            parts.append(f"| `{f.name}` | `{_default(default)}` | {text} |")
        parts.append("")
    return "\n".join(parts)


_FAMILIES = {"GaugeMetricFamily": "gauge", "CounterMetricFamily": "counter", "HistogramMetricFamily": "histogram"}


def metrics() -> str:
    """Every metric family harvest/ops/metrics.py defines: name, type, labels, help."""
    sys.path.insert(0, str(ROOT))
    module = importlib.import_module("harvest.ops.metrics")
    rows: list[tuple[str, str, list[str], str]] = []
    tree = ast.parse((ROOT / "harvest" / "ops" / "metrics.py").read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FAMILIES):
            continue
        name, help_ = node.args[0], node.args[1] if len(node.args) > 1 else None
        if not (isinstance(name, ast.Constant) and isinstance(help_, ast.Constant)):
            continue  # the families built from STATS and HISTOGRAMS, below
        labels = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "labels"), [])
        rows.append((name.value, _FAMILIES[node.func.id], labels, help_.value))
    for metric, help_ in module.STATS.values():
        rows.append((metric, "counter", ["run"], help_))
    for name, help_ in module.HISTOGRAMS.items():
        rows.append((f"harvest_{name}", "histogram", ["run"], help_))
    table = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for name, kind, labels, help_ in rows:
        if kind == "histogram":
            kind = "histogram (`_bucket` with `le`, `_sum`, `_count`)"
        labels_text = ", ".join(f"`{x}`" for x in labels)
        table.append(f"| `{name}` | {kind} | {labels_text} | {help_.replace('|', '/')} |")
    return "\n".join(table)


GENERATORS = {"settings": settings, "environment": environment, "metrics": metrics}


def _first_sentence(text: str) -> str:
    """The first sentence of a command's help, however many lines it spans."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = re.search(r"[.!?](\s|$)", paragraph)
    return paragraph[: end.end()].strip() if end else paragraph


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the generated tables; on the command-line page, give each command a one-sentence summary
    (mkdocs-click lists subcommands by the first line of their help, which cuts a sentence in two)."""
    if page.file.src_uri == "reference/cli.md":
        from harvest.cli import main

        for command in main.commands.values():
            if command.help and not command.short_help:
                command.short_help = _first_sentence(command.help)
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


def on_page_content(html: str, page, config, files) -> str:
    """mkdocs-click prints click 8.3's marker for "no default" as `Sentinel.UNSET`: show nothing instead.
    The command-line page is wrapped in `cli-reference`, whose option names stay on one line (extra.css)."""
    html = html.replace("<code>Sentinel.UNSET</code>", "")
    if page.file.src_uri == "reference/cli.md":
        html = f'<div class="cli-reference">{html}</div>'
    return html
