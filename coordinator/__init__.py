"""The weightsync coordinator: session store, version state machine, handshake, watch."""

__all__: list[str] = []
