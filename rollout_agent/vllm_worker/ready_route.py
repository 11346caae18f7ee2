"""`GET /weightsync/ready` on vLLM's OpenAI server: the in-engine backend's readiness probe.

vLLM's `/health` answers 200 once the engine runs, whatever weights it holds: a server that
restarted serves its load-time (or dummy) weights as if they were current. This route
answers 200 only when every worker of the engine serves the session's newest committed
version, verified (each worker's `weightsync_readiness`, through `collective_rpc`: the
sidecar's rule, `sync.readiness`), else 503. The body names each worker's serving and
committed versions and why it is not ready:

    {"ready": false, "workers": [{"agent_id": "srv", "session": "job", "serving": 0,
      "committed": 4, "ready": false, "reason": "serves version 0; ..."}, ...]}

Only where the workers answer it (a weightsync worker extension, `--worker-extension-cls`);
elsewhere 503 saying so. The `weightsync` plugin installs it in vLLM's server process,
beside the responses' provenance (`openai_provenance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PATH = "/weightsync/ready"
METHOD = "weightsync_readiness"
TIMEOUT_S = 10.0  # the workers answer between two engine steps; each reads the coordinator once (2 s at most)
_WRAPPED = "__weightsync_ready_route__"


def verdict(answers: Sequence[Any]) -> tuple[int, dict[str, Any]]:
    """The status and body for the workers' answers: 200 only when there is one and every
    one is ready."""
    workers = [
        a if isinstance(a, dict) else {"ready": False, "reason": f"an answer not understood: {a!r}"} for a in answers
    ]
    ready = bool(workers) and all(w.get("ready") is True for w in workers)
    return (200 if ready else 503), {"ready": ready, "workers": workers}


async def ready(raw_request: Any) -> Any:
    """The route's handler (FastAPI)."""
    from fastapi.responses import JSONResponse

    from rollout_agent.vllm_worker.openai_provenance import workers_answer

    client = getattr(raw_request.app.state, "engine_client", None)
    if client is None:
        return JSONResponse({"ready": False, "reason": "this server runs no engine"}, status_code=503)
    if not workers_answer(getattr(client, "vllm_config", None), METHOD):
        reason = "the engine's workers have no weightsync worker extension (--worker-extension-cls)"
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)
    try:
        answers = await client.collective_rpc(METHOD, timeout=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a probe's answer: not ready, and why
        return JSONResponse({"ready": False, "reason": f"{type(e).__name__}: {e}"}, status_code=503)
    status, body = verdict(answers)
    return JSONResponse(body, status_code=status)


def install() -> None:
    """Adds the route to every app vLLM's server builds after this call, once per process."""
    from fastapi import Request
    from vllm.entrypoints.launchers import app as launcher

    original = launcher.register_api_routers
    if getattr(original, _WRAPPED, False):
        return

    ready.__annotations__ = {"raw_request": Request}  # FastAPI injects by the class (this module's are strings)

    def register_api_routers(args: Any, app: Any, *rest: Any, **kwargs: Any) -> None:
        original(args, app, *rest, **kwargs)
        app.add_api_route(PATH, ready, methods=["GET"], include_in_schema=False)

    setattr(register_api_routers, _WRAPPED, True)
    launcher.register_api_routers = register_api_routers
