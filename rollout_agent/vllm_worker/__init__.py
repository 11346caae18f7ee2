"""The rollout inside a vLLM worker: the weight-transfer backend, the worker extensions, the sidecar's own engine."""
