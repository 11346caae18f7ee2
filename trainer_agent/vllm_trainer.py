"""vLLM's trainer-side engine under its public import path: `trainer_agent.vllm_trainer` is
the module `trainer_agent.vllm.engine` itself (importing either registers the `weightsync`
backend once)."""

import sys

from trainer_agent.vllm import engine

sys.modules[__name__] = engine
