"""Where a config's YAML comes from: a packaged config's name (`tiny`) or a file's path.

The packaged configs are the files of the repository's top-level `configs/`, which the wheel
installs as the package `rollout.configs` (pyproject.toml maps the folder there), so a name works
from any directory and from an installed package. Owns: that lookup and its error for an unknown
name. Does not own: reading or checking a config (`rollout.config`).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path


def packaged_config(name: str) -> Path:
    """A file of the packaged configs (`tiny.yaml`, `example_prompts.jsonl`)."""
    return _packaged_configs() / name


def packaged_config_names() -> list[str]:
    """The names `load_config` and the `rollout` command take for the packaged configs."""
    return sorted(p.stem for p in _packaged_configs().glob("*.yaml"))


def _packaged_configs() -> Path:
    """The package `rollout.configs` of an installed wheel, which maps the checkout's top-level
    `configs/` there; that folder itself in a checkout that no install maps."""
    try:
        return Path(str(importlib.resources.files("rollout.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "configs"


def config_path(path: str | Path) -> Path:
    """The YAML file `path` names: a packaged config's name (`tiny`, no folder and no suffix) or a
    file path. Raises FileNotFoundError for a name no packaged config has, listing those there are."""
    if isinstance(path, str) and path and not any(c in path for c in ("/", os.sep, ".")):
        found = packaged_config(f"{path}.yaml")
        if not found.is_file():
            names = ", ".join(packaged_config_names())
            raise FileNotFoundError(
                f"no packaged config named {path!r} (packaged: {names}); or give a YAML file's path"
            )
        return found
    return Path(path)
