"""The generated reference pages (config, CLI, metrics, Python API, benchmark results) are what
docs/gen_reference.py makes from the code now: a key, flag, metric or export that changed without
its page failing here, with the difference and the command that regenerates them."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

import msgspec
import msgspec.inspect
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves its Structs' annotations through it
    spec.loader.exec_module(module)
    return module


GEN = _generator()
GENERATED = GEN.pages()


@pytest.mark.parametrize("page", sorted(GENERATED), ids=str)
def test_the_generated_page_is_fresh(page: Path) -> None:
    path = ROOT / page
    assert path.is_file(), f"{page}: missing; run python docs/gen_reference.py"
    want, have = GENERATED[page], path.read_text()
    if have != want:
        diff = difflib.unified_diff(
            have.splitlines(), want.splitlines(), f"{page} (file)", f"{page} (code)", lineterm=""
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"{page} is stale; run python docs/gen_reference.py\n{shown}", pytrace=False)


def test_a_config_key_without_a_meaning_stops_the_generator() -> None:
    """Each key's meaning is the string under its field; a field without one is named."""

    class Section(msgspec.Struct):
        documented: int = 1
        """What it means."""
        bare: int = 2

    fields = list(msgspec.inspect.type_info(Section).fields)
    with pytest.raises(ValueError, match=r"Section\.bare: no meaning"):
        list(GEN._section("section", Section, fields))
