"""harvest: distributed extraction of LLM hidden states for EAGLE-3 drafter training data."""

__version__ = "0.1.0"
