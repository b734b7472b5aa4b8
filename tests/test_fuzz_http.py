"""The fuzz tier on the HTTP server: generated bodies (valid JSON of wrong shapes, raw bytes, deep
nesting, lone surrogates) at every route of `rollout serve`, over fake engines. Each example is
answered within BOUND_S by a success or an error in OpenAI's shape, never a 500; a well-formed
request sent at the same time is answered 200; the server serves on.
Deterministic (derandomized) like tests/test_fuzz.py; `ROLLOUT_FUZZ_EXAMPLES` scales the number of
examples, `ROLLOUT_FUZZ_RANDOM=1` draws new ones each run."""

from __future__ import annotations

import contextlib
import json
import os

import anyio
import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from rollout.engine import RolloutEngine
from rollout.serve.openai_api import ROLES
from tests.support.fakes import FakePool
from tests.support.serving import serve_cfg

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400"))
BOUND_S = 5.0  # every example is answered within this, or it hangs: a failure
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("ROLLOUT_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

POST_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/inference/v1/generate",
    "/tokenize",
    "/v1/episodes/ep/reward",
]
GET_ROUTES = ["/v1/models", "/health", "/metrics"]
ROUTES = POST_ROUTES + GET_ROUTES + ["/v1/nothing", "/v1/episodes/%F0%9F%98%80/reward", "/v1/episodes//reward"]

EDGE_INTS = [0, 1, 2, 5, 259, 260, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**80, -(2**63) - 1]
INTS = st.one_of(st.integers(-3, 300), st.sampled_from(EDGE_INTS), st.booleans())
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5, -0.0, 1e308])
)
TEXT = st.text(
    alphabet=st.characters(categories=["L", "N", "P", "Zs", "Cc", "Cs"]), max_size=10
)  # Cs: lone surrogates, sent as \ud800
SCALARS = st.one_of(INTS, FLOATS, TEXT, st.none())
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6
)
IDS = st.lists(INTS, max_size=6) | VALUES
PARTS = st.lists(
    st.fixed_dictionaries({}, optional={"type": st.just("text") | TEXT, "text": TEXT | VALUES}), max_size=2
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | TEXT},
    optional={
        "content": TEXT | PARTS | VALUES,
        "tool_calls": VALUES | st.lists(st.fixed_dictionaries({"function": VALUES}), max_size=2),
        "prompt_token_ids": IDS,
        "generation_token_ids": IDS,
        "name": TEXT | VALUES,
        "tool_call_id": VALUES,
    },
)
SAMPLING = {
    "max_tokens": INTS | VALUES,
    "max_completion_tokens": INTS,
    "temperature": FLOATS | INTS | VALUES,
    "top_p": FLOATS | VALUES,
    "top_k": INTS,
    "min_tokens": INTS,
    "seed": INTS | VALUES,
    "stop": TEXT | st.lists(TEXT, max_size=3) | VALUES,
    "stop_token_ids": IDS,
    "n": INTS | VALUES,
}
FIELDS = {
    "model": st.just("tiny") | VALUES,
    "messages": st.lists(MESSAGE, max_size=3) | VALUES,
    "prompt": TEXT | IDS | st.lists(TEXT | IDS, max_size=2),
    "token_ids": IDS,
    "sampling_params": st.fixed_dictionaries({}, optional=SAMPLING) | VALUES,
    "stream": st.booleans() | VALUES,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": VALUES}) | VALUES,
    "logprobs": VALUES,
    "tools": st.lists(VALUES, max_size=2) | VALUES,
    "tool_choice": VALUES,
    "session_id": TEXT | VALUES,
    "episode_id": TEXT | VALUES,
    "required_prefix_token_ids": IDS,
    "return_token_ids": VALUES,
    "return_tokens_as_token_ids": VALUES,
    "reward": FLOATS | INTS | VALUES,
    "request_id": VALUES,
    **SAMPLING,
}
BODY = st.fixed_dictionaries({}, optional=FIELDS)  # anything, mostly wrong
WELL_FORMED = {  # a body each route serves; a variant with one or two fields changed gets past the first checks
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "abc", "max_tokens": 2},
    "/inference/v1/generate": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    "/tokenize": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/episodes/ep/reward": {"reward": 1.0},
}
DEEP = st.builds(lambda n, key: (f'{{"{key}": ' + "[" * n + "]" * n + "}").encode(), st.integers(50, 3000),
                 st.sampled_from(["messages", "tools", "prompt", "sampling_params", "x"]))  # fmt: skip
RAW = st.one_of(
    st.binary(max_size=40), DEEP, st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe{}", b'{"a": NaN}'])
)
CHANGES = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.one_of(*FIELDS.values()), max_size=2)


def bodies(route: str) -> st.SearchStrategy[bytes]:
    base = WELL_FORMED.get(route, {})
    return st.one_of(
        BODY.map(lambda b: json.dumps(b).encode()), RAW, CHANGES.map(lambda c: json.dumps({**base, **c}).encode())
    )


REQUESTS = st.sampled_from(ROUTES).flatmap(
    lambda route: st.tuples(st.just(route), st.sampled_from(["POST", "POST", "POST", "GET"]), bodies(route))
)


@contextlib.asynccontextmanager
async def serving(api_servers: int):
    async with RolloutEngine(
        serve_cfg("sampling.max_tokens=4", "serve.max_concurrency=64", f"serve.api_servers={api_servers}"),
        pool=FakePool(2),
    ) as engine:
        yield await engine.serve(port=0)


@pytest.fixture(scope="module", params=[1, 2], ids=["in-process", "2-front-end-processes"])
def server(request):
    """One served engine on fake engines for the module (no deadline: each example has its own),
    on a loop in a thread of its own; served in its process, then by two front-end processes
    (every request's values cross to the backend as msgpack)."""
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(serving(request.param)) as s:
        yield s


async def exchange(url: str, method: str, route: str, body: bytes) -> tuple[httpx.Response, httpx.Response]:
    """The fuzzed request, and a well-formed chat sent while it is in flight."""
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as http:
        out: dict[str, httpx.Response] = {}

        async def fuzzed() -> None:
            out["fuzzed"] = await http.request(
                method, route, content=body, headers={"content-type": "application/json"}
            )

        async def good() -> None:
            out["good"] = await http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            )

        with anyio.fail_after(BOUND_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fuzzed)
                tg.start_soon(good)
    return out["fuzzed"], out["good"]


@FUZZ
@given(request=REQUESTS)
@example(
    request=(
        "/v1/chat/completions",
        "POST",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    )
)
@example(
    request=(
        "/v1/chat/completions",
        "POST",
        b'{"messages": [{"role": "user", "content": "x"}], "required_prefix_token_ids": [%d]}' % 2**80,
    )
)
@example(
    request=("/v1/chat/completions", "POST", b'{"messages": [{"role": "user", "content": "x"}], "top_k": %d}' % 2**70)
)
# found by hand (all three were 500s; the last through front-end processes only: msgpack carries
# no such int), and a GET on a POST route (FastAPI's own shape before)
@example(request=("/v1/chat/completions", "GET", b"{}"))
def test_every_route_answers_any_body_without_a_500(server, request):
    route, method, body = request
    r, good = anyio.run(exchange, server.url, method, route, body)  # a loop of its own; the server's runs in the portal
    event(f"{route} {r.status_code}")  # --hypothesis-show-statistics: which answers the bodies got
    assert r.status_code < 500, f"{method} {route} {body[:200]!r}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert (
            set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code and error["message"]
        ), r.text
    assert good.status_code == 200, f"a well-formed request sent meanwhile: {good.status_code} {good.text[:300]}"
