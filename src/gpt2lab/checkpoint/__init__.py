"""Layer 4: a run's state saved and loaded (store: the full layout; sharded: DCP)."""
