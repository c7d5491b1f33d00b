"""File formats: the bytes on disk that one process writes and another reads (dump, spool, shard, index)."""
