"""What a checkpoint is, cheaply: the fingerprint a run records of its model (run.json's
`model_fingerprint`) and every part that meets the model checks against.

A run's states mean something only for the weights that computed them, so the run knows its model
by what the checkpoint folder holds, not by its path: a symlink or a copy of it is the same model,
and weights replaced under the same path are not. The fingerprint hashes, per file:

- the config (`config.json`, `generation_config.json`) and every tokenizer file present (the
  tokens a row becomes, chat templates included): whole, they are small;
- safetensors weights by their header: the 8-byte length and the JSON header (every tensor's
  name, dtype, shape and byte offsets), the file's size, and SAMPLES samples of SAMPLE_BYTES of
  its tensor bytes spread evenly over the file (64 KiB a file, whatever its size: never a full
  read); `model.safetensors.index.json` whole. So other weights of the same shapes saved over
  the checkpoint (a fine-tune, another seed: nearly every value differs) are seen by the samples,
  and another or re-shaped checkpoint by the headers. NOT seen: an edit that keeps every header
  and touches none of the sampled bytes (a few values, or one small tensor, changed in place);
  `harvest audit` recomputes samples against the model and finds that;
- `.bin` weights (torch's zip format) by their zip directory: each member's name, size and CRC-32,
  which torch computed over the tensor bytes when it saved them (so value changes are seen); an
  older pickle `.bin` (not a zip) by its size and its first and last MiB.

Modification times are left out on purpose: a copy has other ones and is the same model.
The digest is SHA-256 over the per-file hashes; messages show its first 12 hex digits.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from typing import Any

from harvest.errors import InputError

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
SAMPLES, SAMPLE_BYTES = 16, 4096
_EDGE = 1 << 20
SHORT = 12


class FingerprintError(InputError, ValueError):
    """A checkpoint file that cannot be fingerprinted (a safetensors file with a broken header)."""


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _whole(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _safetensors(path: str) -> str:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FingerprintError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise FingerprintError(f"{path}: its header length {n} does not fit the file ({size} bytes)")
        header = f.read(n)
        start, end = 8 + n, size
        step = max(end - start - SAMPLE_BYTES, 0)
        samples = [os.pread(f.fileno(), SAMPLE_BYTES, start + step * i // (SAMPLES - 1)) for i in range(SAMPLES)]
    return _sha(b"safetensors", str(size).encode(), head, header, *samples)


def _torch_bin(path: str) -> str:
    size = os.path.getsize(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            members = sorted((i.filename, i.file_size, i.CRC) for i in z.infolist())
        return _sha(b"torch-zip", str(size).encode(), json.dumps(members).encode())
    with open(path, "rb") as f:
        first = f.read(_EDGE)
        f.seek(max(size - _EDGE, 0))
        last = f.read(_EDGE)
    return _sha(b"torch-pickle", str(size).encode(), first, last)


def _hashed(name: str) -> bool:
    return (
        name in CONFIG_FILES or name in TOKENIZER_FILES or name.endswith(INDEX_SUFFIX) or name.endswith(WEIGHT_SUFFIXES)
    )


def model_fingerprint(model_dir: str) -> dict[str, Any] | None:
    """`{"digest": hex, "files": {name: hex}}` of the checkpoint in the local folder `model_dir`
    (followed through symlinks); None when `model_dir` is no local folder (a hub id), or holds
    none of the files above. Reads the config and tokenizer files and the weights' headers only."""
    if not os.path.isdir(model_dir):
        return None
    files: dict[str, str] = {}
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if not _hashed(name) or not os.path.isfile(path):
            continue
        if name.endswith(".safetensors"):
            files[name] = _safetensors(path)
        elif name.endswith(".bin"):
            files[name] = _torch_bin(path)
        else:
            files[name] = _whole(path)
    if not files:
        return None
    return {"digest": _sha(json.dumps(files, sort_keys=True).encode()), "files": files}


def short(fp: dict[str, Any] | None) -> str:
    """The digest as messages show it (`none` for a run that records no fingerprint)."""
    return fp["digest"][:SHORT] if fp else "none"


def same_model(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Two fingerprints name the same checkpoint (both recorded and equal)."""
    return bool(a and b and a.get("digest") == b.get("digest"))


def differing(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The files whose hashes differ between `a` and `b` (missing on one side included), sorted."""
    fa, fb = (a or {}).get("files", {}), (b or {}).get("files", {})
    return sorted(n for n in set(fa) | set(fb) if fa.get(n) != fb.get(n))


def mismatch_line(
    run: str,
    recorded: dict[str, Any] | None,
    recorded_path: str,
    found: dict[str, Any] | None,
    found_path: str,
    where: str,
    who: str = "",
) -> str:
    """One line naming both checkpoints: the run's (recorded in `where`) and the one found at
    `found_path` (by `who`, e.g. an engine, when not by the command itself), and what differs."""
    if recorded is None:
        return (
            f"run {run!r} records no model fingerprint in {where}: it cannot tell whether "
            f"{found_path} (fingerprint {short(found)}) is its model; `harvest accept-model --run {run} --model "
            f"{found_path}` records it, if it is"
        )
    diff = differing(recorded, found)
    what = (
        f"; differs in {', '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}"
        if found and found.get("files") and diff
        else ""
    )
    seen = f"{who} {found_path}, fingerprint" if who else f"{found_path} has fingerprint"
    return (
        f"run {run!r} was extracted from the model with fingerprint {short(recorded)} (at {recorded_path}, "
        f"recorded in {where}), but {seen} {short(found)}{what}: another checkpoint, or the same path with other "
        f"weights; use another --run, or `harvest accept-model --run {run} --model {found_path}` if it is the same "
        "model saved again"
    )
