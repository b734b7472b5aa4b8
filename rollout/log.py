"""Log output: the engine's own lines on the console, the libraries' under it in the run's files.

Owns: structlog's setup (readable console lines by default, JSON lines on request), and where
vLLM's, Ray's and torch's output goes. By default it leaves the console: each engine start gets a
folder under `logging.dir` (its path logged once), with `driver.log` for the libraries' log records
in this process and `engine-<i>.log` for everything engine `i`'s processes print (vLLM's log,
torch's warnings and C++ notices, loading bars). What this project logs itself stays on the
console, from the driver and from the engines alike; so do the libraries' errors in the driver,
and an engine that cannot start says why in its error (`policies.startup`). `-v`
(`logging.verbose`) or `logging.level: debug` leaves every stream where it is.
Does not own: the progress lines (`rollout.bench.progress`) or what the CLI prints.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import structlog

ENGINE_LOG_ENV = "ROLLOUT_ENGINE_LOG"  # an engine's log file, set in its environment (`policies.vllm_args`)
# The loggers of the libraries the engine runs on; their records go to the run's driver.log.
LIBRARIES = ("vllm", "ray", "torch", "transformers", "triton", "huggingface_hub")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str = "info", json: bool = False, stream: TextIO | None = None) -> None:
    """This process's structlog lines at `level` and above, to `stream` (default: stderr)."""
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S" if not json else "iso"),
    ]
    processors.append(structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str):
    return structlog.get_logger(name)


def quiet(level: str, verbose: bool) -> bool:
    """Whether the libraries' output leaves the console: unless `-v` or `logging.level: debug`."""
    return not verbose and level != "debug"


def open_run_logs(root: str, level: str, verbose: bool) -> Path | None:
    """For an engine start, unless the console shows everything (`quiet`): a new folder under
    `root`, this process's library loggers sent to its driver.log (`libraries_to_file`), its path
    logged once. Returns the folder; None when nothing changes."""
    if not quiet(level, verbose):
        return None
    run = Path(root).absolute() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run.mkdir(parents=True, exist_ok=True)
    libraries_to_file(run / "driver.log")
    get_logger(__name__).info("vLLM, Ray and torch output", logs=str(run))
    return run


def libraries_to_file(path: Path) -> None:
    """In this process, the records of `LIBRARIES`' loggers go to `path`; errors also to stderr.

    Their own console handlers (Ray's, vLLM's) are replaced. vLLM configures its logger when first
    imported; `VLLM_CONFIGURE_LOGGING=0` keeps it from replacing these handlers then.
    """
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    errors.setFormatter(logging.Formatter(_FORMAT))
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        for old in logger.handlers[:]:
            logger.removeHandler(old)
        logger.addHandler(to_file)
        logger.addHandler(errors)
        logger.propagate = False
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"


def output_to_file(path: str | None) -> TextIO | None:
    """In an engine's process: everything it and the processes it starts write to stdout and
    stderr (vLLM's log, Python warnings, C++ notices, loading bars) goes to `path`, appended.
    Returns a stream on the stderr the process had, for this project's own lines (under Ray, a
    file Ray forwards to the driver's console); None, changing nothing, when `path` is None.

    Redirected at the file descriptors, since the engine's own processes inherit them and
    torch's C++ code writes to them directly. Calling it again with the same path changes nothing
    more."""
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    here, there = os.fstat(fd), os.fstat(2)
    if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):  # already redirected
        os.close(fd)
        return None
    console = os.fdopen(os.dup(2), "w", buffering=1)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


STARTS_ENV = "ROLLOUT_ENGINE_STARTS"  # a file: one JSON line per engine start (the test suite's count)


def record_engine_start(kind: str, engines: int, seconds: float) -> None:
    """Log an engine start; where `$ROLLOUT_ENGINE_STARTS` names a file, also append it there as
    one JSON line (the test suite sums them at its end, across every process it started)."""
    get_logger(__name__).debug("engine start", kind=kind, engines=engines, seconds=round(seconds, 1))
    if path := os.environ.get(STARTS_ENV):
        line = json.dumps({"kind": kind, "engines": engines, "seconds": round(seconds, 2), "pid": os.getpid()})
        with open(path, "a") as f:  # one short write per line: appends from several processes stay whole
            f.write(line + "\n")
