"""The dump directory's layout: every name in it, and where it is by default.

The dump dir is node-local (tmpfs by default) and shared by one engine and the workers beside
it. Who owns what in it:

- `<rid>.<start>-<end>.safetensors` (rids start with `hv-`, harvest.ids): written by the engine
  through a `.tmp-` name and renamed; the engine owns a file until the rename, then nobody until
  a worker claims it by renaming it into its claim dir.
- `.claimed-<worker>/`: one worker's private claim dir, owned by that worker while its heartbeat
  lives. A janitor removes it once the heartbeat is gone (so a worker that comes back late finds
  its claims gone, and the rename of a claimed file fails instead of resurrecting it).
- `.vllm/`: the vLLM server's own per-request files (`shared_storage_path`), owned by the server
  until the worker's vLLM client turns them into dump chunks; neither claim nor the janitor
  touches it, since its names are not `hv-` names.
- `.tmp-*`: a chunk in flight; unowned once its writer died, removed by the janitor when stale.
"""

from __future__ import annotations

import os
import tempfile

CLAIM_PREFIX = ".claimed-"
VLLM_SUBDIR = ".vllm"
TEMP_PREFIX = ".tmp-"


def claim_dir(dump_dir: str, worker: str) -> str:
    """A worker's private claim dir inside the dump dir."""
    return os.path.join(dump_dir, f"{CLAIM_PREFIX}{worker}")


def claim_dir_owner(name: str) -> str | None:
    """The worker name of a claim dir's entry name, None for any other entry."""
    return name[len(CLAIM_PREFIX) :] if name.startswith(CLAIM_PREFIX) else None


def vllm_dir(dump_dir: str) -> str:
    """Where the vLLM server writes its per-request files (its `shared_storage_path`)."""
    return os.path.join(dump_dir, VLLM_SUBDIR)


def temp_chunk_path(dump_dir: str, name: str) -> str:
    """The in-flight name of chunk file `name`; unique per writing process."""
    return os.path.join(dump_dir, f"{TEMP_PREFIX}{name}.{os.getpid()}")


def is_temp(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)


def default_dump_dir(run: str | None = None) -> str:
    """The default dump dir of a run on this node, for `harvest run` and for the engine command
    that `harvest sglang-args` / `vllm-args` print: in memory (/dev/shm) when it is writable,
    private to the user, one folder per run."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        base = os.path.join(shm, f"harvest-{os.getuid()}")
    else:
        base = os.path.join(tempfile.gettempdir(), f"harvest-dump-{os.getuid()}")
    return os.path.join(base, run) if run else base
