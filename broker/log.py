"""Logging setup for the command line: readable console by default, JSON lines on request."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

# Longest text kept per logged value: a peer's input never turns into megabytes of log (issue #14).
MAX_LOGGED_CHARS = 2000


def cap_long_values(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Shorten every long string in an event, saying how long it was."""
    for key, value in event.items():
        if key != "exception" and isinstance(value, str) and len(value) > MAX_LOGGED_CHARS:
            event[key] = f"{value[:MAX_LOGGED_CHARS]}... ({len(value)} chars)"
    return event


def configure_logging(json_lines: bool = False, level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    # JSON lines carry an internal error's traceback as text under "exception"; the console renderer
    # prints it by itself.
    renderer: list[structlog.types.Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if json_lines
        else [structlog.dev.ConsoleRenderer(colors=False)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            cap_long_values,
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (print writes the newline apart): game copies launched with --env-path share
        # this stream, and their output must not land inside a log line.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
