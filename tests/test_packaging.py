"""The wheel carries the whole project: built from a clean export of the tree, installed outside the
checkout, every module imports from the install and `rollout validate` runs on the packaged config.

An editable install (what `make setup` does) maps the source folders and hides what the wheel
leaves out, so this builds a real wheel: a package missing from it (once `policies/vllm_adapter/`)
makes `pip install .` unable to start an engine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout", "actors", "policies", "benchmarks")

CHECK = r"""
import importlib, pkgutil, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
names = []
for top in sys.argv[2:]:
    pkg = importlib.import_module(top)
    names.append(top)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
for name in names:
    mod = importlib.import_module(name)
    where = Path(mod.__file__).resolve()
    assert where.is_relative_to(site), f"{name} imported from {where}, not from the installed wheel"
from rollout.cli import main
code = main(["validate"])
assert code == 0, f"rollout validate on the packaged config exited {code}"
print("modules", len(names))
"""


def _export(dest: Path) -> None:
    """The files a clean export holds: tracked ones and new ones git does not ignore."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_a_wheel_from_a_clean_export_installs_every_module_and_the_default_config(tmp_path):
    export, dist, site = tmp_path / "export", tmp_path / "dist", tmp_path / "site"
    export.mkdir()
    _export(export)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(export)], check=True, cwd=tmp_path
    )
    (wheel,) = dist.glob("rollout-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp_path)
    source = {p.relative_to(export) for top in PACKAGES for p in (export / top).rglob("*.py")}
    installed = {p.relative_to(site) for top in PACKAGES for p in (site / top).rglob("*.py")}
    assert source <= installed, f"the wheel leaves out {sorted(map(str, source - installed))}"
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(site), *PACKAGES],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
