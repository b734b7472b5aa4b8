"""The fuzz tier for episodes: generated `Step`s and observation messages through the episode loop
(one `RolloutEngine` on fake engines for the whole module), each example bounded in time.

Each example is one prompt's group of 3 episodes; the first environment built answers every turn
with the generated value (a `Step` or a tuple with fields of any type: text, NaN, inf, bools,
dicts, lists, None, huge ints; observations of wrong roles, content types and `tool_calls` shapes;
or an exception, `BaseException`s included), sync or async. Promised: no hang; the other two
episodes of the group finish; the bad episode fails naming the field (`Step.reward`, `Step.done`,
`Step.observation...`) or what was raised, or it finishes with a finite reward; the engine serves on.
Deterministic (derandomized) like `tests/test_fuzz.py`; `ROLLOUT_FUZZ_EXAMPLES` scales it.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rollout.engine import RolloutEngine
from rollout.episodes.env import Step
from rollout.types import Prompt
from tests.support.episodes import Echo, episode_cfg
from tests.support.fakes import FakePool

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400"))
BOUND_S = 10.0  # every example answers within this, or it hangs: a failure
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("ROLLOUT_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# -- inputs -----------------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(categories=["L", "N", "P", "Zs", "Cc", "Cs"]), max_size=8)  # Cs: lone surrogates
NUMBERS = st.one_of(
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400), float("nan"), float("inf"), 1.0, 0]),
)
ODD = st.sampled_from([object(), {1, 2}, b"bytes", 1j, Ellipsis])  # nothing JSON can carry
SCALARS = st.one_of(NUMBERS, st.booleans(), TEXT, st.none(), ODD)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6
)
ROLES = st.sampled_from(["user", "tool", "system", "assistant", "robot", "", "\ud800"]) | VALUES
FUNCTION = st.fixed_dictionaries(
    {}, optional={"name": TEXT | VALUES, "arguments": TEXT | st.dictionaries(TEXT, VALUES, max_size=2) | VALUES}
)
TOOL_CALL = st.fixed_dictionaries(
    {}, optional={"type": st.just("function") | VALUES, "id": TEXT | VALUES, "function": FUNCTION | VALUES}
)
TOOL_CALLS = st.lists(TOOL_CALL, max_size=2) | VALUES
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": TEXT | VALUES,
        "tool_calls": TOOL_CALLS,
        "name": TEXT | VALUES,
        "tool_call_id": TEXT | VALUES,
        "odd": VALUES,
    },
)
TOOL_MESSAGE = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.text(max_size=4), "tool_calls": TOOL_CALLS}
)
GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "tool", "system"]), "content": st.text(max_size=8)}
)
TOKEN_IDS = st.lists(st.integers(-3, 300) | st.sampled_from([2**63, True]), min_size=1, max_size=6)
OBSERVATIONS = st.one_of(
    st.none(),
    TEXT,
    TOKEN_IDS,
    MESSAGE,
    GOOD_MESSAGE,
    TOOL_MESSAGE,
    st.lists(MESSAGE | GOOD_MESSAGE | TOOL_MESSAGE, max_size=3),
    VALUES,
)
REWARDS = NUMBERS | st.booleans() | VALUES
DONES = st.booleans() | VALUES
RAISES = st.sampled_from(
    [ValueError("bad action"), SystemExit(2), asyncio.CancelledError(), KeyboardInterrupt(), GeneratorExit()]
)
GOOD_OBSERVATIONS = st.one_of(st.text(max_size=8), st.lists(st.integers(0, 259), min_size=1, max_size=4), GOOD_MESSAGE,
                              st.lists(GOOD_MESSAGE, min_size=1, max_size=2))  # fmt: skip
ANSWERS = st.one_of(
    st.builds(
        Step, observation=GOOD_OBSERVATIONS, reward=st.floats(-1e6, 1e6), done=st.booleans()
    ),  # well-formed: both outcomes
    st.builds(Step, observation=OBSERVATIONS, reward=REWARDS, done=DONES),  # a Struct checks nothing when built
    st.tuples(OBSERVATIONS, REWARDS, DONES),
    RAISES,
    VALUES,
)


OUTCOMES = [
    "Step.reward",
    "Step.done",
    "tool_calls",
    ".role",
    ".content",
    "Step.observation",
    "vocabulary",
    "returned no observation",
    "raised",
    "expected a Step",
]


class Script:
    """What the next group's first environment answers; the engine's env factory reads it."""

    answer: object = None
    sync = False
    built = 0

    def build(self):
        self.built += 1
        if self.built > 1:
            return Echo()
        return (SyncHostile if self.sync else Hostile)(self.answer)


class Hostile(Echo):
    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    async def step(self, action):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class SyncHostile(Hostile):
    def step(self, action):  # in a worker thread
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


SCRIPT = Script()


@pytest.fixture(scope="module")
def portal_engine():
    """One engine on fake engines for every example, on its own loop in a thread (`portal.call`)."""
    config = episode_cfg("sampling.n=3", "episode.max_turns=3", "episode.step_timeout_s=5")
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(RolloutEngine(config, pool=FakePool(2), env=SCRIPT.build)) as engine:
            yield portal, engine
            SCRIPT.answer, SCRIPT.sync, SCRIPT.built = Step(None, 1.0, True), False, 0
            assert portal.call(play, engine).ok  # it serves on after every example


async def play(engine: RolloutEngine):
    with anyio.fail_after(BOUND_S):
        (group,) = await engine.submit([Prompt(text="go")], train=False).result()
    return group


def finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@FUZZ
@given(answer=ANSWERS, sync=st.booleans())
def test_a_generated_step_fails_its_episode_only_naming_the_field(portal_engine, answer, sync):
    portal, engine = portal_engine
    if isinstance(answer, KeyboardInterrupt) and not sync:
        sync = True  # on the loop's thread it may be the process's own Ctrl-C: it passes (rollout.inputs.usercode)
    SCRIPT.answer, SCRIPT.sync, SCRIPT.built = answer, sync, 0
    group = portal.call(play, engine)
    assert not group.error and len(group.trajectories) == 3
    failed = [t for t in group.trajectories if not t.ok]
    event(
        next((f"failed: {m}" for m in OUTCOMES if failed and m in failed[0].error), "failed: other")
        if failed
        else "finished"
    )
    assert len(failed) <= 1, [t.error for t in failed]
    others = [t for t in group.trajectories if t.ok and t.reward == 3.0 and len(t.turns) == 3]
    assert len(others) >= 2, [(t.error, t.reward) for t in group.trajectories]  # Echo's episodes all finish
    fields = (
        answer
        if isinstance(answer, tuple)
        else (answer.observation, answer.reward, answer.done)
        if isinstance(answer, Step)
        else None
    )
    if isinstance(answer, BaseException):
        (ep,) = failed
        assert f"environment step of turn 0 raised {type(answer).__name__}" in ep.error
    elif fields is None:
        (ep,) = failed
        assert "environment step of turn 0 returned" in ep.error and "expected a Step" in ep.error
    elif not finite(fields[1]):
        (ep,) = failed
        assert "environment step of turn 0: Step.reward: expected a finite number, got" in ep.error
    elif not isinstance(fields[2], bool):
        (ep,) = failed
        assert "Step.done: expected a bool, got" in ep.error
    elif failed:  # the observation: a field named, or one of the documented outcomes
        (ep,) = failed
        assert ep.error.startswith(f"episode {ep.request_id}: ")
        assert any(s in ep.error for s in ("Step.observation", "outside the vocabulary", "returned no observation")), (
            ep.error
        )
    for ep in group.trajectories:
        assert ep.ok or ep.finish_reason == "error"
        assert not ep.ok or (ep.reward is not None and math.isfinite(ep.reward))  # never a NaN for the learner
