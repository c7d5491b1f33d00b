"""The documentation site (mkdocs.yml, docs/) is complete and free of history.

The site is built once per session with `mkdocs build --strict` (a broken link, a missing page or a
reference page that cannot be generated fails the build). Then every command and option of the
click tree, every metric `harvest metrics` defines, every failure reason and every exit code the CLI
can return must be in it; each list is read from the code here, not from the hook that generates
pages, so a page that drops one fails. Without the docs extra (`pip install -e '.[docs]'`) the
build tests skip, or fail under CI=true (tests/support/need.py).

A second group reads README.md and docs/**/*.md as text: user documents name no issue, no "stop N"
and no commit; history lives in git.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tests.support.cli import REPO
from tests.support.need import need

ROOT = Path(REPO)
DOCS = ROOT / "docs"


# --- the built site -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site, built once with --strict into a temporary folder."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_click") is None:
        need("mkdocs (the docs extra)", "pip install -e '.[docs]' builds the documentation site")
    out = tmp_path_factory.mktemp("site") / "site"
    env = {**os.environ, "PYTHONPATH": REPO, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def text_of(page: Path) -> str:
    """A built page's text: tags removed, entities decoded, whitespace collapsed."""
    raw = page.read_text()
    body = raw.split("<article", 1)[-1]  # the page's content, not the navigation
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def sections(page: Path) -> dict[str, str]:
    """A built page's text under each heading, by the heading's id."""
    raw = page.read_text()
    parts = re.split(r'<h[1-6] id="([^"]+)"', raw)
    return {
        parts[i]: " ".join(html.unescape(re.sub(r"<[^>]+>", " ", parts[i + 1])).split())
        for i in range(1, len(parts) - 1, 2)
    }


def commands() -> list[tuple[str, click.Command]]:
    """Every command of `harvest`, as (its full name, the click command), the group included."""
    from harvest.cli import main

    out = []

    def walk(prefix: str, cmd: click.Command) -> None:
        out.append((prefix, cmd))
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.list_commands(click.Context(cmd))):
                walk(f"{prefix} {name}", cmd.get_command(click.Context(cmd), name))

    walk("harvest", main)
    return out


def test_every_command_and_option_is_in_the_cli_reference(site):
    by_id = sections(site / "reference" / "cli" / "index.html")
    missing = []
    for name, cmd in commands():
        anchor = name.replace(" ", "-")
        if anchor not in by_id:
            missing.append(f"{name} (no section)")
            continue
        section = by_id[anchor]
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                missing += [
                    f"{name} {opt}"
                    for opt in param.opts + param.secondary_opts
                    if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", section)
                ]
    assert len(commands()) > 15 and not missing, missing


def served_metrics() -> set[str]:
    """Every metric name harvest/ops/metrics.py defines: its literal names and its histograms."""
    from harvest.ops.metrics import HISTOGRAMS

    source = (ROOT / "harvest" / "ops" / "metrics.py").read_text()
    return set(re.findall(r'"(harvest_[a-z_]+)"', source)) | {f"harvest_{n}" for n in HISTOGRAMS}


def test_every_metric_is_in_the_metrics_reference(site):
    names = served_metrics()
    page = text_of(site / "reference" / "metrics" / "index.html")
    assert len(names) > 20 and "harvest_samples_done_total" in names
    assert sorted(n for n in names if not re.search(rf"(?<![\w]){n}(?![\w])", page)) == []


def test_every_failure_reason_is_in_the_troubleshooting_page(site):
    from harvest.state import failures

    constants = {v for k, v in vars(failures).items() if k.isupper() and isinstance(v, str)}
    assert constants == set(failures.REASONS)  # a reason defined but not listed would escape the check
    page = sections(site / "guides" / "troubleshooting" / "index.html")["failure-reasons"]
    assert sorted(r for r in failures.REASONS if not re.search(rf"(?<![\w-]){r}(?![\w-])", page)) == []


def exit_codes() -> set[int]:
    """Every exit status the CLI returns: the errors' statuses, the constants, and sys.exit(N)."""
    codes = set()
    for path in [
        ROOT / "harvest" / "errors.py",
        ROOT / "harvest" / "state" / "connection.py",
        *(ROOT / "harvest" / "cli").glob("*.py"),
    ]:
        source = path.read_text()
        codes |= {int(c) for c in re.findall(r"(?:exit_status|_EXIT)\s*=\s*(\d+)", source)}
        codes |= {int(c) for c in re.findall(r"sys\.exit\((\d+)\)", source)}
    return codes


def test_every_exit_code_is_in_the_exit_codes_reference(site):
    codes = exit_codes()
    assert {0, 1, 2, 75, 77, 130} <= codes
    raw = (site / "reference" / "exit-codes" / "index.html").read_text()
    listed = {int(c) for c in re.findall(r"<tr>\s*<td><code>(\d+)</code></td>", raw)}
    assert sorted(codes - listed) == []


# --- no history in user documents -------------------------------------------------------------------

ISSUE = re.compile(r"\b(?:issues?|stop|PR|pull request)\s+#?\d+\b|(?<![\w&/#`])#\d+\b", re.I)
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
# Hex ids a format uses, allowed inside code (fenced blocks, inline code) only: model fingerprints
# (12), shard and sample ids (32). A commit hash is never one of these lengths as git abbreviates.
CODE_ID_LENGTHS = {12, 32}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE = re.compile(r"`[^`]+`")  # a span may wrap to the next line


def history(text: str) -> list[str]:
    """The issue references and commit hashes in a Markdown text."""
    found = [m.group(0) for m in ISSUE.finditer(text)]
    code = [m.group(0) for m in FENCE.finditer(text)]
    prose = FENCE.sub(" ", text)
    code += INLINE.findall(prose)
    prose = INLINE.sub(" ", prose)

    def hashes(s: str, allowed: set[int]) -> list[str]:
        return [w for w in HEX.findall(s) if re.search(r"[a-f]", w) and re.search(r"\d", w) and len(w) not in allowed]

    found += hashes(prose, set())
    for block in code:
        found += hashes(block, CODE_ID_LENGTHS)
    return found


def user_documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("path", user_documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_documents_name_no_issue_and_no_commit(path):
    assert history(path.read_text()) == []


@pytest.mark.parametrize(
    "text, found",
    [
        ("fixed in issue 12, see #29", ["issue 12", "#29"]),
        ("as stop 53 measured", ["stop 53"]),
        ("at 2342cb7 the figure", ["2342cb7"]),
        ("`before is 7d85523`", ["7d85523"]),
        ("```\ncommit 0a1b2c3d4e5f60718293a4b5c6d7e8f901234567\n```", ["0a1b2c3d4e5f60718293a4b5c6d7e8f901234567"]),
        ("```\nFAIL sample 8117c9289f0739d73a0cb618850da2c3 (shard 594f456123a7bb6f34fd4f36d8874900)\n```", []),
        ("fingerprint `3f2a9c0e41b7`", []),
        ("a 32-hex id outside code: 8117c9289f0739d73a0cb618850da2c3", ["8117c9289f0739d73a0cb618850da2c3"]),
        ("blake2b-128, fp8_e4m3, 1e-4, deadbeef, [link](#failure-reasons)", []),
    ],
)
def test_the_history_check_finds_issues_and_hashes_and_spares_format_ids(text, found):
    assert history(text) == found


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert lines[:3] == ["# harvest", "", "```bash"]
    assert lines[3].startswith("pip install torch==2.13.0 && pip install -e '.[dev]' && harvest demo")
    assert lines[4].startswith("python -m pytest -q")
