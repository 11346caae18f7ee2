"""Device arrays to host blocks: the blocks and their window, the snapshot, the D2H thread, glibc's heaps."""
