"""What takes a verified version into an engine: the `Applier` contract and the NumPy, JAX and vLLM appliers."""
