"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link or anchor, a
page left out of the navigation, or an API object mkdocstrings cannot find fails the suite, as it
fails `make docs`. The build goes to a temporary directory; it takes a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strict(tmp_path: Path) -> None:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: pip install -e '.[dev]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, "mkdocs build --strict:\n" + "\n".join(warnings or [done.stderr])
