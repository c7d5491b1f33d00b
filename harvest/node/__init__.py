"""Node-local filesystem layout: private directories and the dump directory's names."""
