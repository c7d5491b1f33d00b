"""harvest: distributed extraction of LLM hidden states for EAGLE-3 drafter training data.

The wings (producer/, workers/, collector/, engines/) are folders beside this package in the
repository and subpackages of it once installed (pyproject.toml's package-dir): `harvest.workers`
and so on. A checkout put on sys.path without an install (an engine's venv, `python bench/...`)
finds them beside this folder."""

import os as _os

__version__ = "0.1.0"

_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "workers", "__init__.py")) and not _os.path.isdir(
    _os.path.join(__path__[0], "workers")
):
    __path__.append(_checkout)
