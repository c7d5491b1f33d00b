"""Redis CPU by harvest script (bench/fleet.py --by-script).

`INFO commandstats` gives one figure for all of EVALSHA. SLOWLOG with a threshold of 0 logs every
command with its duration and first arguments, so a script call names its script by SHA, which
`script_names` maps back to the module constant that holds the script's text. The log itself costs
the server a little (it copies each command's first arguments), so a run measured this way is
slower than the plain fleet run: its µs are for ranking the scripts, not for the table. The
duration of a script's call includes its inner calls (which the log also lists on their own).
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
import re
from collections import Counter

import redis

import harvest

LOG_LEN = 2_000_000
CUT = 128  # Redis's SLOWLOG_ENTRY_MAX_STRING: a longer argument is logged as its first 128 bytes
MORE = re.compile(rb"^(.{128})\.\.\. \((\d+) more bytes\)$", re.S)


def _eval_key(head: bytes, size: int) -> str:
    return f"{size}:{head.hex()}"


def script_names() -> dict[str, str]:
    """SHA1 (for EVALSHA) and the text's first CUT bytes with its length (for EVAL, whose text the
    log cuts there, saying how many bytes more) -> `module.CONSTANT` of every Lua script held in a
    module-level string of harvest."""
    names = {}
    for mod in pkgutil.walk_packages(harvest.__path__, "harvest."):
        if mod.name.endswith("__main__") or ".cli" in mod.name or ".read" in mod.name:
            continue  # no scripts there; a __main__ runs the CLI, the readers import torch
        for attr, value in vars(importlib.import_module(mod.name)).items():
            if isinstance(value, str) and "redis.call" in value and not attr.startswith("__"):
                name = f"{mod.name.removeprefix('harvest.')}.{attr}"
                raw = value.encode()
                names[hashlib.sha1(raw).hexdigest()] = names[_eval_key(raw[:CUT], len(raw))] = name
    return names


class ScriptLog:
    """Every command of a stretch of time in SLOWLOG, then the script calls in it summed by name."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self.names = script_names()
        self._saved: dict[str, str] = {}

    def __enter__(self) -> ScriptLog:
        for key in ("slowlog-log-slower-than", "slowlog-max-len"):
            self._saved.update(self.conn.config_get(key))
        self.conn.config_set("slowlog-max-len", LOG_LEN)
        self.conn.execute_command("SLOWLOG", "RESET")
        self.conn.config_set("slowlog-log-slower-than", 0)
        return self

    def read(self) -> tuple[Counter, Counter, int]:
        """(µs by script, calls by script, entries logged): read before leaving the block."""
        usec, calls = Counter(), Counter()
        entries = self.conn.execute_command("SLOWLOG", "GET", LOG_LEN)
        for entry in entries:
            args = entry[3]
            cmd = args[0].decode().upper() if args else ""
            if cmd not in ("EVALSHA", "EVAL") or len(args) < 2:
                continue
            if cmd == "EVALSHA":
                key = args[1].decode()
            else:
                cut = MORE.match(args[1])
                key = _eval_key(cut[1], CUT + int(cut[2])) if cut else _eval_key(args[1], len(args[1]))
            name = self.names.get(key, f"script {key[:12]}") + (" (EVAL)" if cmd == "EVAL" else "")
            usec[name] += entry[2]
            calls[name] += 1
        return usec, calls, len(entries)

    def __exit__(self, *exc) -> None:
        for key, value in self._saved.items():
            self.conn.config_set(key, value)
        self.conn.execute_command("SLOWLOG", "RESET")
