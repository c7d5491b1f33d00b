"""Node-local directories that hold run data (dump dir, spool, claim dirs).

Anyone who can plant files there can feed a worker: the directories are created owner-only
(0700), and a directory or file that is a symlink is refused rather than followed, so a
link cannot redirect writes or reads to somewhere else on the node.
"""

from __future__ import annotations

import os
import stat

from harvest.errors import ConfigurationError


class UnsafePath(ConfigurationError, OSError):
    """A path harvest will not use: a symlink, or not what it should be."""


def private_dir(path: str, what: str = "directory") -> str:
    """Create `path` 0700 if missing; refuse it if it is a symlink or not a directory."""
    if os.path.islink(path):
        raise UnsafePath(f"{what} {path} is a symlink; refusing to follow it (point harvest at the real directory)")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UnsafePath(f"{what} {path} exists and is not a directory")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} exists and is not a directory")
    return path


def check_regular_file(path: str) -> os.stat_result:
    """lstat `path` and refuse anything but a regular file (a symlink is never followed)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symlink; refused")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file; refused")
    return st
