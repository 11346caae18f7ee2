"""weightsync: gRPC weight sync between JAX trainers and vLLM rollout workers."""

__version__ = "0.1.0"

__all__ = ["__version__"]
