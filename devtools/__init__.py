"""Development tools: the demo launcher, the process cluster tests and benchmarks start, and
the tiny vLLM model writer. Nothing under weightsync/, coordinator/, trainer_agent/ or
rollout_agent/ imports this package (an import-linter contract)."""
