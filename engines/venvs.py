"""The engines' own virtual environments (vLLM, SGLang): where each lives and how to tell a
finished one. Each engine pins a torch and dependencies harvest does not use, so it runs from a
venv its script builds (scripts/vllm_venv.sh, scripts/sglang_venv.sh); the script writes
`.harvest-complete` last, so a venv whose build was interrupted is never taken for a ready one."""

from __future__ import annotations

import os
from dataclasses import dataclass

from harvest.errors import ConfigurationError


class VenvMissing(ConfigurationError, FileNotFoundError):
    """An engine's venv is not there, or its build did not finish; the message names the script."""


@dataclass(frozen=True)
class EngineVenv:
    engine: str  # as messages name it: "vLLM", "SGLang CPU"
    env_var: str  # overrides the default location
    dirname: str  # under ~/.cache/harvest
    script: str  # what builds it
    cost: str  # how long and how big, for the message

    def default(self) -> str:
        return os.environ.get(self.env_var) or os.path.join(os.path.expanduser("~"), ".cache", "harvest", self.dirname)

    def python(self, venv: str | None = None) -> str:
        """The venv's python; a clear error naming the build script when it is missing or unfinished."""
        venv = venv or self.default()
        python = os.path.join(venv, "bin", "python")
        if not (os.path.isfile(os.path.join(venv, ".harvest-complete")) and os.access(python, os.X_OK)):
            raise VenvMissing(
                f"no complete {self.engine} venv at {venv}: build it with {self.script} "
                f"({self.cost}), or point {self.env_var} at one"
            )
        return python
