"""Errors the client side raises."""

from __future__ import annotations


class BrokerError(RuntimeError):
    """The broker refused us or went away; ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
