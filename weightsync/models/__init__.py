"""Model forwards over HF-named parameters (pure JAX; imported only by those who run one)."""

__all__: list[str] = []
