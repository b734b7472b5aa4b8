"""structlog setup: readable console lines by default, JSON lines on request."""

from __future__ import annotations

import json
import logging
import os
import sys

import structlog


def configure(level: str = "info", json: bool = False) -> None:
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S" if not json else "iso"),
    ]
    processors.append(structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str):
    return structlog.get_logger(name)


STARTS_ENV = "ROLLOUT_ENGINE_STARTS"  # a file: one JSON line per engine start (the test suite's count)


def record_engine_start(kind: str, engines: int, seconds: float) -> None:
    """Log an engine start; where `$ROLLOUT_ENGINE_STARTS` names a file, also append it there as
    one JSON line (the test suite sums them at its end, across every process it started)."""
    get_logger(__name__).debug("engine start", kind=kind, engines=engines, seconds=round(seconds, 1))
    if path := os.environ.get(STARTS_ENV):
        line = json.dumps({"kind": kind, "engines": engines, "seconds": round(seconds, 2), "pid": os.getpid()})
        with open(path, "a") as f:  # one short write per line: appends from several processes stay whole
            f.write(line + "\n")
