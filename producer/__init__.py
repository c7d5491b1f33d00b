"""The producer: dataset rows -> tokenized samples with loss masks -> bounded, idempotent RQ jobs."""
