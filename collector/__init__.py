"""The collector: spooled samples -> committed shards in storage -> done in the ledger."""
