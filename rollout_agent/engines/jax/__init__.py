"""A verified version into a JAX engine's sharded `jax.Array`s, checked on its devices (NumPy and JAX only)."""
