"""Model implementations, keyed by the `architectures` name in config.json."""
