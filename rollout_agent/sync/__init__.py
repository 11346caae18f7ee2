"""Sync rounds (pull, verify, apply, handshake) and what drives them: following the session, prefetch, the outbox."""
