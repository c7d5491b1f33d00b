"""Reading the source tree with ast, for tests/unit/test_house.py: the files, the first-party
imports, the string literals, the numeric and string defaults bound to names, and the class tree."""

from __future__ import annotations

import ast
import builtins
import os

from tests.support.cli import REPO

WINGS = ("producer", "workers", "collector", "engines")
PACKAGES = ("harvest", *WINGS)
ERROR_ROOT = "HarvestError"


def read(path: str) -> str:
    """The text of a file of the repository (relative `path`)."""
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def py_files() -> list[str]:
    out = []
    for top in (*PACKAGES, "tests", "bench", "scripts"):
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.relpath(os.path.join(d, n), REPO) for n in names if n.endswith(".py")]
    return sorted(out)


def module_name(path: str) -> str:
    """The module a file of the repository is imported as: a wing's folder is a subpackage of
    harvest (workers/job.py: harvest.workers.job)."""
    mod = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
    return f"harvest.{mod}" if mod.split(".")[0] in WINGS else mod


def package_of(module: str) -> str:
    """The part of the house a module belongs to: a wing's name, "harvest" (the core), or "tests"."""
    parts = module.split(".")
    return parts[1] if parts[0] == "harvest" and len(parts) > 1 and parts[1] in WINGS else parts[0]


def first_party(name: str) -> bool:
    return name.split(".")[0] in (*PACKAGES, "tests")


def imports(path: str) -> set[str]:
    """First-party modules `path` imports (at module level or inside functions)."""
    tree = ast.parse(read(path), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if first_party(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and first_party(node.module):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def literals(path: str) -> list[str]:
    """Every string constant in `path` except docstrings, f-string pieces included."""
    tree = ast.parse(read(path), path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def source_files() -> list[str]:
    return [f for f in py_files() if f.split(os.sep)[0] in PACKAGES]


def holders(match) -> set[str]:
    return {f for f in source_files() if any(match(s) for s in literals(f))}


def number(node: ast.AST) -> float | None:
    """The value of a numeric constant expression (`60.0`, `64 << 30`, `6 * 3600.0`), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = number(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = number(node.left), number(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.LShift):
            return a << b if isinstance(a, int) and isinstance(b, int) else None
        ops = {ast.Mult: lambda: a * b, ast.Add: lambda: a + b, ast.Pow: lambda: a**b}
        return ops[type(node.op)]() if type(node.op) in ops else None
    return None


def constant(node: ast.AST) -> float | str | None:
    """A numeric constant expression's value (`number`), or a string constant's, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return number(node)


def flag_name(call: ast.Call) -> str:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return " ".join(f.lstrip("-").replace("-", "_") for f in flags)


def bindings(path: str) -> list[tuple[str, float | str, int]]:
    """(name, value, line) of every numeric or string constant bound to a name in `path`: a
    parameter's default, an assignment or a class field, a call's keyword (click's `default=` by
    the option's flags)."""
    tree = ast.parse(read(path), path)
    out = []

    def bind(name: str | None, value: ast.AST | None) -> None:
        v = None if value is None else constant(value)
        if name and v is not None:
            out.append((name.lower(), v, value.lineno))

    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=False):
                bind(arg.arg, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=False):
                bind(arg.arg, default)
        elif isinstance(n, ast.Call):
            for kw in n.keywords:
                bind(flag_name(n) if kw.arg == "default" else kw.arg, kw.value)
        elif isinstance(n, ast.AnnAssign):
            bind(getattr(n.target, "id", None) or getattr(n.target, "attr", None), n.value)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                bind(getattr(t, "id", None) or getattr(t, "attr", None), n.value)
    return out


def classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of the packages: "path:Name" -> (its module path, its bases' last names)."""
    out = {}
    for top in PACKAGES:
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for n in names:
                if not n.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(d, n), REPO)
                tree = ast.parse(read(path), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        out[f"{path}:{node.name}"] = (path, [ast.unparse(b).split(".")[-1] for b in node.bases])
    return out


def resolve(name: str, path: str, classes) -> list[str]:
    """The repository classes a base name may be: the one in the same file, else any of that name."""
    same = f"{path}:{name}"
    return [same] if same in classes else [k for k in classes if k.endswith(f":{name}")]


def ancestors(key: str, classes, seen=None) -> set[str]:
    """Every base name up the class's tree (repository classes by key, others by name)."""
    seen = set() if seen is None else seen
    path, bases = classes[key]
    out = set()
    for b in bases:
        found = resolve(b, path, classes)
        out |= set(found) or {b}
        for k in found:
            if k not in seen:
                seen.add(k)
                out |= ancestors(k, classes, seen)
    return out


def is_exception(key: str, classes) -> bool:
    def foreign_exception(name: str) -> bool:
        b = getattr(builtins, name, None)
        return (isinstance(b, type) and issubclass(b, BaseException)) or name.endswith(("Error", "Exception"))

    return any(":" not in a and foreign_exception(a) for a in ancestors(key, classes))


def in_root(key: str, classes) -> bool:
    return any(a.endswith(f":{ERROR_ROOT}") for a in ancestors(key, classes))
