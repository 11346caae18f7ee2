"""The arena's slots, the chunk servers that serve them, and the fs store parts a replaced trainer left."""
