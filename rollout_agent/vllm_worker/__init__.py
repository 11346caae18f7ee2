"""The rollout inside a vLLM worker: the backend, the worker extensions, the sidecar's engine, responses' provenance."""
