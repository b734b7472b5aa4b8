"""A CPU engine's processes come after the driver (`policies.cpu_engine`): the kernel's autogroups
apply nice only within a session, and Ray's workers share the raylet's, so Ray's worker nice alone
left the driver's session level with every engine together (the driver starved)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies.cpu_engine import AUTOGROUP, ENGINE_NICE

ROOT = Path(__file__).resolve().parents[1]
HAS_AUTOGROUP = Path(AUTOGROUP).exists()


def in_own_session(code: str) -> str:
    """Run `code` in a Python process leading a session of its own (an autogroup of its own where
    the kernel has them), so that nothing it lowers is this test's."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="a kernel without autogroups")
def test_behind_driver_lowers_the_autogroup_and_leaves_the_callers_alone():
    ours = Path(AUTOGROUP).read_text()
    said = in_own_session(
        "from policies.cpu_engine import behind_driver; print(behind_driver()); "
        "print(open('/proc/self/autogroup').read())"
    )
    reported, actual = said.splitlines()
    assert reported == actual.strip() and actual.endswith(f" nice {ENGINE_NICE}"), said
    assert Path(AUTOGROUP).read_text() == ours, "the test's own session was lowered"


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="a kernel without autogroups")
def test_behind_driver_never_raises_a_priority():
    said = in_own_session(
        "open('/proc/self/autogroup', 'w').write('19')\n"
        "from policies.cpu_engine import behind_driver; print(behind_driver())"
    )
    assert said.endswith(" nice 19"), said


def test_without_autogroups_the_process_nice_orders_it():
    said = in_own_session(
        "import policies.cpu_engine as c; c.AUTOGROUP = '/nonexistent/autogroup'; print(c.behind_driver()); "
        "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    )
    assert said.splitlines() == [f"nice {ENGINE_NICE}", str(ENGINE_NICE)]


def test_in_the_root_autogroup_the_process_nice_orders_it(tmp_path):
    # A process that never started a session (a container's init and all below it) is in the root
    # autogroup, whose /proc/PID/autogroup reads empty: nice orders it there, as without autogroups.
    (root := tmp_path / "autogroup").write_text("")
    said = in_own_session(
        f"import policies.cpu_engine as c; c.AUTOGROUP = {str(root)!r}; print(c.behind_driver()); print(c.session()); "
        "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    )
    assert said.splitlines() == [f"nice {ENGINE_NICE}", "", str(ENGINE_NICE)], said
    assert root.read_text() == ""


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="a kernel without autogroups")
def test_an_autogroup_the_driver_is_in_is_left_alone():
    # A raylet started from the driver's own session: lowering that group would lower the driver
    # (and the user's shell) with the engines; Ray's worker nice already orders them inside it.
    said = in_own_session(
        "import os; from policies import cpu_engine as c; os.environ[c.DRIVER_SESSION] = c.session(); "
        "print(c.behind_driver()); print(open('/proc/self/autogroup').read())"
    )
    reported, actual = said.splitlines()
    assert actual.endswith(" nice 0") and reported.endswith("the driver's"), said


def test_each_cpu_engine_is_told_the_drivers_session():
    from policies.cpu_engine import DRIVER_SESSION, session
    from policies.vllm_args import engine_env

    assert engine_env(0, 1, 0)[DRIVER_SESSION] == session()
    assert DRIVER_SESSION not in engine_env(0, 1, 1)  # a GPU engine is left as it is
