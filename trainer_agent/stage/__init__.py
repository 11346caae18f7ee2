"""A parameter tree into a slot: the staging paths, host shards and their layout, the FFI path, deltas."""
