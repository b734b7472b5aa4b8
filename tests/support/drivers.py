"""A driver script in its own process, for tests that signal it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A shell starts background jobs with SIGINT ignored and a child inherits that, so Python installs
# no KeyboardInterrupt handler: a SIGINT test would test the launcher. Ctrl-C as a terminal gives it:
CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def start_python(code: str, *args: str) -> subprocess.Popen:
    """`python -c code args` in the repository root, pipes on, SIGINT raising KeyboardInterrupt."""
    return subprocess.Popen(
        [sys.executable, "-c", CTRL_C + code, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
