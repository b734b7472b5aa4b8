"""Generated prompts for the fuzz tiers (hypothesis strategies): token ids (huge, negative, bool),
text (lone surrogates included), dicts with odd fields and sampling overrides of every type, and
`Prompt`s made in code; well-formed ones too, so that both outcomes occur. `PROMPTS` is the lot;
tests/test_fuzz.py and tests/integration/test_robust.py throw it at the engine."""

from __future__ import annotations

from hypothesis import strategies as st

from rollout.types import Prompt

EDGE_INTS = [0, 1, 2, 259, 260, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -(2**63), -(2**63) - 1]
INTS = st.one_of(st.integers(-3, 300), st.sampled_from(EDGE_INTS), st.integers(-(2**80), 2**80), st.booleans())
FLOATS = st.one_of(
    st.floats(),
    st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0, 2.0000001, -0.0, 1e308, float("nan"), float("inf"), -float("inf")]),
)
TEXT = st.text(alphabet=st.characters(categories=["L", "N", "P", "Zs", "Cc", "Cs"]), max_size=12)  # Cs: lone surrogates
SCALARS = st.one_of(INTS, FLOATS, TEXT, st.none())
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=5
)
SAMPLING_FIELDS = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "stop_token_ids",
    "stop",
    "seed",
    "logprobs",
]
SAMPLING_VALUES = st.one_of(
    st.sampled_from([float("nan"), float("inf"), True, 2**64, -1, None, [], "\ud800"]),
    INTS,
    FLOATS,
    TEXT,
    st.lists(INTS, max_size=3),
    st.lists(TEXT, max_size=3),
    st.sampled_from(["processed", "raw"]),
)
OVERRIDES = st.dictionaries(st.sampled_from(SAMPLING_FIELDS) | TEXT, SAMPLING_VALUES, max_size=4)
TOKEN_IDS = st.lists(INTS, max_size=10)
PROMPT_DICTS = st.fixed_dictionaries(
    {},
    optional={"token_ids": TOKEN_IDS | VALUES, "text": TEXT | VALUES, "id": TEXT | INTS, "sampling": OVERRIDES | VALUES,
              "metadata": st.dictionaries(TEXT, VALUES, max_size=2), "odd": VALUES},
)  # fmt: skip
PROMPT_OBJECTS = st.builds(
    Prompt, token_ids=st.none() | TOKEN_IDS, text=st.none() | TEXT, id=TEXT, sampling=OVERRIDES
)  # a Prompt made in code: its constructor checks no types
GOOD_IDS = st.lists(st.integers(0, 259), min_size=1, max_size=10)
GOOD_TEXT = st.text(alphabet=st.characters(categories=["L", "N", "P", "Zs"]), min_size=1, max_size=12)
GOOD = st.one_of(
    GOOD_IDS,
    GOOD_TEXT,
    st.fixed_dictionaries({"token_ids": GOOD_IDS}, optional={"sampling": OVERRIDES, "id": GOOD_TEXT}),
)
PROMPTS = st.one_of(GOOD, TOKEN_IDS, TEXT, PROMPT_DICTS, PROMPT_OBJECTS, SCALARS)  # well-formed ones too: both outcomes
