"""The engine wing: code that runs inside, or launches, an engine process (reference engine,
SGLang plugin, vLLM connector). It imports only `harvest/`; the vLLM connector imports nothing
from harvest at all, since it loads inside vLLM's own venv."""
