"""The fuzz tier: generated inputs at the public API, each answered within a bounded time by
success or by an error of the documented kind. Hand-written cases test what someone thought of;
these find where a validator accepts what the next layer cannot carry (msgpack on the engines'
wire, vLLM's own checks, the weight checks), which today would hang a group or fail it late.

- prompts (token ids incl. huge, negative and bool; text incl. lone surrogates; dicts with odd
  fields and sampling overrides of every type) through `RolloutEngine` over real `RayEngine`
  handles and `VLLMPolicy` objects on a fake vLLM (`tests.support.wire`): every request crosses msgpack;
- `Sampling` values: whatever the validator accepts encodes and decodes to itself, as a `Request`;
- `-o key=value` overrides at random keys (known and unknown) with YAML values of every kind;
- weight dicts (odd names, dtypes, shapes, values) through `update_weights` on fake engines.
Deterministic (derandomized: the same examples every run, so CI is stable); `ROLLOUT_FUZZ_EXAMPLES`
scales the number of examples (default below), `ROLLOUT_FUZZ_RANDOM=1` draws new ones each run.
`tests/integration/test_robust.py` sends a few generated prompts through the real engines too.
"""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rollout.config import config_from_dict, load_config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidConfigError, InvalidPromptError, InvalidWeightsError, RolloutError
from rollout.inputs.prompts import effective_sampling
from rollout.types import Prompt, Request, Sampling
from tests.support.fakes import FakePool
from tests.support.strategies import FLOATS, INTS, OVERRIDES, PROMPTS, SAMPLING_FIELDS, SCALARS, TEXT, VALUES
from tests.support.wire import WirePool

try:
    import policies.vllm_args as vllm_args  # vLLM's argument classes, imported by engine_args (a few seconds)
except ImportError:  # no vLLM installed: the config is still fuzzed up to its own checks
    vllm_args = None

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400"))
BOUND_S = 5.0  # every example answers within this, or it hangs: a failure
# ROLLOUT_FUZZ_RANDOM=1: fresh random examples each run (exploring), not CI's fixed ones
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("ROLLOUT_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_model_dir(tmp_path_factory):
    """One model directory for the module: hypothesis runs every example within one test call."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text('{"vocab_size": 260}')
    save_file(
        {"embed.weight": torch.zeros(4, 3), "norm.weight": torch.ones(3, dtype=torch.bfloat16)},
        str(d / "model.safetensors"),
    )
    return d


def config(model_dir, *overrides: str):
    return load_config(None, ["sampling.n=2", "sampling.max_tokens=4", "engines.count=1", "model.max_model_len=32",
                              "logging.level=error", f"model.path={model_dir}", *overrides])  # fmt: skip


def bounded(fn, *args):
    """Run `fn(*args)` (a coroutine function) on a fresh loop within BOUND_S: a hang fails the example."""

    async def main():
        with anyio.fail_after(BOUND_S):
            return await fn(*args)

    return anyio.run(main)


# -- prompts through the engine, across the wire ----------------------------------------------


@FUZZ
@given(prompt=PROMPTS)
def test_a_prompt_is_served_or_refused_as_documented(fuzz_model_dir, prompt):
    async def run():
        cfg = config(fuzz_model_dir)
        async with RolloutEngine(cfg, pool=await WirePool.start(cfg)) as engine:
            try:
                engine.feed([prompt])
                accepted = True
            except InvalidPromptError:
                accepted = False
            engine.feed(iter([prompt]))  # lazily: the same prompt, refused as a failed group
            return accepted, [g async for g in engine.groups()]

    accepted, groups = bounded(run)
    event("accepted" if accepted else "refused")  # --hypothesis-show-statistics: both happen
    assert len(groups) == (2 if accepted else 1)
    for g in groups:
        errors = [g.error] if g.error else [t.error for t in g.trajectories if not t.ok]
        assert accepted or g.error, "refused by feed(list) but served from an iterator"
        for error in errors:  # an accepted prompt may still fail in the engine only as documented
            assert not accepted or "exceed max_model_len" in error, f"accepted, then failed: {error}"


# -- Sampling on the wire ---------------------------------------------------------------------


@FUZZ
@given(raw=OVERRIDES)
def test_sampling_values_the_validator_accepts_cross_the_wire(raw):
    try:
        sampling = effective_sampling(Sampling(), Prompt(token_ids=[5], sampling=raw))
    except InvalidPromptError:
        return
    request = Request("r", "p", 0, sampling, token_ids=[5, 6])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([("0", [request])]), type=list[tuple[str, list[Request]]]) == [
        ("0", [request])
    ]


# -- config overrides -------------------------------------------------------------------------

CONFIG_KEYS = [
    "model.max_model_len",
    "model.seed",
    "model.dtype",
    "engines.count",
    "engines.cpus_per_engine",
    "engines.gpus_per_engine",
    "engines.max_inflight_per_engine",
    "engines.queued_per_engine",
    "engines.start_timeout_s",
    "engines.health_interval_s",
    "engines.request_timeout_s",
    "engines.vllm",
    "engines.vllm.kv_cache_gib",
    *(f"sampling.{f}" for f in SAMPLING_FIELDS),
    "prompts.count",
    "prompts.min_len",
    "prompts.max_len",
    "weight_sync.mode",
    "weight_sync.timeout_s",
    "staleness.max_lag",
    "staleness.batch_groups",
    "queue.max_groups",
    "queue.order",
    "reward",
    "env",
    "ray.address",
    "ray.num_cpus",
    "metrics.port",
    "speculative.method",
    "speculative.num_speculative_tokens",
    "bench.rounds",
    "episode.max_turns",
]
YAML_VALUES = st.one_of(
    INTS.map(str),
    FLOATS.map(lambda f: {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(str(f), repr(f))),
    st.sampled_from(
        [
            ".nan",
            ".inf",
            "-.inf",
            "true",
            "null",
            "[]",
            "{}",
            "[1, 2]",
            "~",
            "'x'",
            "{a: 1}",
            "[",
            "{",
            "{kv_cache_gib: .inf}",
            "{kv_cache_gib: .nan}",
            "{kv_cache_gib: 1e300}",
            "{max_num_seqs: -1}",
        ]
    ),
    TEXT,
)


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS) | TEXT, YAML_VALUES), min_size=1, max_size=3))
def test_a_config_override_loads_or_names_the_problem(fuzz_model_dir, pairs):
    overrides = [f"{key}={value}" for key, value in pairs]
    try:
        cfg = load_config(None, overrides)
    except InvalidConfigError:
        event("refused")
        return
    event("loaded")
    sampling = msgspec.msgpack.decode(
        msgspec.msgpack.encode(cfg.sampling), type=Sampling
    )  # it crosses the wire in every request
    assert sampling == cfg.sampling
    if vllm_args is not None:
        try:  # vLLM's engine arguments: built, or refused naming the key
            vllm_args.engine_args(cfg, str(fuzz_model_dir))
        except InvalidConfigError:
            pass


EDGES = [float("nan"), float("inf"), -float("inf"), True, False, 0, -1, 1e300, 2**64, "1", None, [], {}]
VLLM_KEYS = [
    "kv_cache_gib",
    "max_num_seqs",
    "gpu_memory_utilization",
    "enforce_eager",
    "seed",
    "max_model_len",
    "not_an_arg",
    "\ud800",
]


@pytest.mark.skipif(vllm_args is None, reason="needs vLLM's argument classes")
@FUZZ
@given(
    extra=st.fixed_dictionaries(
        {}, optional={k: st.one_of(st.sampled_from(EDGES), FLOATS, INTS, TEXT, VALUES) for k in VLLM_KEYS}
    )
)
def test_vllm_engine_args_are_built_or_refused_naming_the_key(fuzz_model_dir, extra):
    try:
        cfg = config_from_dict({"engines": {"vllm": extra}})
        vllm_args.engine_args(cfg, str(fuzz_model_dir))
    except InvalidConfigError:
        pass


# -- weights ----------------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
NAMES = st.sampled_from(["embed.weight", "norm.weight"]) | TEXT
SHAPES = st.sampled_from([(4, 3), (3,), (), (0,), (3, 4), (1, 4, 3)]) | st.lists(st.integers(0, 4), max_size=3).map(
    tuple
)
FILLS = st.sampled_from([0.0, 1.0, float("nan"), float("inf"), -1e30])


@st.composite
def tensors(draw):
    dtype, shape, fill = draw(st.sampled_from(DTYPES)), draw(SHAPES), draw(FILLS)
    t = torch.zeros(shape, dtype=dtype)
    if t.is_floating_point() or t.is_complex():
        t = t + fill
    return t


FITTING = st.fixed_dictionaries(  # the model's names, dtypes and shapes; only the values vary (NaN, inf)
    {
        "embed.weight": FILLS.map(lambda f: torch.full((4, 3), f)),
        "norm.weight": FILLS.map(lambda f: torch.full((3,), f, dtype=torch.bfloat16)),
    }
)
WEIGHTS = st.one_of(
    FITTING,
    st.dictionaries(NAMES, tensors() | SCALARS, max_size=3),
    st.fixed_dictionaries({"embed.weight": tensors(), "norm.weight": tensors()}),
    SCALARS,
)


@FUZZ
@given(weights=WEIGHTS)
def test_weights_load_or_are_refused_naming_the_tensor(fuzz_model_dir, weights):
    async def run():
        async with RolloutEngine(config(fuzz_model_dir), pool=FakePool(1)) as engine:
            try:
                return await engine.update_weights(weights)
            except InvalidWeightsError:
                return None

    epoch = bounded(run)
    event("loaded" if epoch else "refused")
    assert epoch in (None, 1)


def test_the_generated_inputs_reach_every_outcome(fuzz_model_dir):
    """The strategies are not vacuous: the fixed prompts below take every path the fuzz asserts on."""

    async def run():
        cfg = config(fuzz_model_dir)
        async with RolloutEngine(cfg, pool=await WirePool.start(cfg)) as engine:
            with pytest.raises(InvalidPromptError):
                engine.feed([{"text": "\ud800"}])
            engine.feed([[5, 6], {"text": "x" * 40}])
            return [g async for g in engine.groups()]

    groups = bounded(run)
    assert sorted(g.ok for g in groups) == [False, True]
    assert isinstance(InvalidPromptError("x"), RolloutError)
