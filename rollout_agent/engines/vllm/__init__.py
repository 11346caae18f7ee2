"""A verified version into a live vLLM model's torch parameters, and the audit of them."""
