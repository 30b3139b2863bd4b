"""Token shards, the prepare pipeline and the loader."""
