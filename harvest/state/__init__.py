"""Shared state in Redis: keys, the per-sample ledger, the run record, heartbeats, the RQ job contract, failures."""
