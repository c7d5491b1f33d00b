"""docs/architecture.md names only modules, files and attributes that exist: a module split,
renamed or deleted fails here until the map says where its contents went."""

from __future__ import annotations

import ast
import os
import re

from tests.support.cli import REPO
from tests.support.house import WINGS

DOC = os.path.join(REPO, "docs", "architecture.md")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:[\w.-]+/)*[\w.-]+\.(?:py|lua|sh|sbatch|yml|yaml|toml)$")
DOTTED = re.compile(r"^harvest(?:\.\w+)+$")
FOLDERS = ("harvest", *WINGS, "tests", "bench", "scripts", "deploy", "docs", ".ci")


def _spans() -> list[str]:
    with open(DOC) as f:
        return [m.group(1).strip() for m in CODE.finditer(f.read())]


def _tree() -> set[str]:
    """Every file of the repository, by its path from the root."""
    out = set(os.listdir(REPO))
    for top in FOLDERS:
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out.update(os.path.relpath(os.path.join(d, n), REPO) for n in names)
    return out


def test_every_file_the_map_names_exists():
    """A path is from the root, or the tail of one (`lua/fence.lua` under a section on harvest/state)."""
    tree = _tree()
    missing = set()
    for span in _spans():
        for word in re.split(r"[\s,;()]+", span):
            if PATH.match(word) and not any(p == word or p.endswith("/" + word) for p in tree):
                missing.add(word)
    assert sorted(missing) == []


def _module_file(parts: list[str]) -> str | None:
    """The file of module `parts` in the tree (a wing's folder is harvest.<wing>), or None."""
    if len(parts) > 1 and parts[1] in WINGS:
        parts = parts[1:]
    base = os.path.join(REPO, *parts)
    for f in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(f):
            return f
    return None


def _defined(path: str) -> set[str]:
    """Every name a file defines: functions, classes, names and attributes assigned, imports, at any depth."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.alias):  # a name a module imports is one it offers too
            out.add(node.asname or node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            out.add(node.id if isinstance(node, ast.Name) else node.attr)
    return out


def _resolves(dotted: str) -> bool:
    """The longest prefix of `dotted` is a module of the tree, and the rest names it defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path:
            return set(parts[cut:]) <= _defined(path)
    return False


def test_every_module_and_name_the_map_names_exists():
    dotted = {w.rstrip(".") for span in _spans() for w in re.split(r"[\s,;()]+", span) if DOTTED.match(w.rstrip("."))}
    assert sorted(w for w in dotted if not _resolves(w)) == []
