"""Access tokens: a session's key (given to its trainers), each version's token (what tcp
and relay servers require of readers) and each agent's key (what calls naming an agent
carry: `coordinator.agent_keys`), all derived from one persistent secret."""

from __future__ import annotations

import hashlib
import hmac

from weightsync.digests import access_token


class TokenKeys:
    """Derives keys and tokens from the coordinator's secret (kept in its database, so
    tokens survive restarts; another coordinator derives others)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def session_key(self, session: str) -> str:
        """HMAC of the session's name under the secret: trainers compute version tokens from it."""
        return hmac.new(self._secret, session.encode(), hashlib.sha256).hexdigest()

    def access_token(self, session: str, version: int) -> str:
        """The token a reader of `version` presents (given with each leased manifest)."""
        return access_token(self.session_key(session), version)

    def agent_key(self, session: str, agent_id: str, role: str, instance: str) -> str:
        """The key of `agent_id` registered in `session` as `role` by the process(es) of
        `instance`: the same for every registration of theirs (a sidecar and its engine),
        another for any other holder of the id."""
        message = "\0".join(("agent", session, agent_id, role, instance)).encode()  # names hold no NUL
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
