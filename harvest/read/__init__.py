"""Reading a finished run's output: shards, the run reader, torch datasets, trainer exports."""
