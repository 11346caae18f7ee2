"""Pulling a version: chunks from the trainer, a relay or a store, verified, assembled, and re-served as a relay."""
