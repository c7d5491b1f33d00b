"""Node-local filesystem layout: private directories, the dump directory's names and the spool directory's."""
