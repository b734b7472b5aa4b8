"""Wire types: everything that crosses a process or API boundary, as msgspec Structs.

Owns: `Prompt` (what a user feeds), `Sampling` (per-request sampling values), `Request` (one
sample sent to one engine), `Trajectory` (one finished sample), `Group` (the `sampling.n` samples
of one prompt), `GroupResult` (an engine's answer for one group), `ProgressReport` (an engine's
samples so far), `EngineStats`, `SpecCounters`. Every field has
a default so old readers keep decoding new data. A trajectory's per-token fields travel packed
(`rollout.packed`: msgpack bins, which readers from before packing refuse) and read lists too.

A trajectory's epoch fields are runs (`rollout.epochs`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from rollout.epochs import expand_runs
from rollout.packed import Logprobs, TokenIds, unpack

FinishReason = Literal["stop", "length", "abort", "error"]

# Bounds of what the next layers carry: msgpack (the engines' wire) holds 64-bit integers, vLLM
# keeps token ids, top-k and lengths in int32 arrays and seeds numpy with 32 bits. A value that
# passes these bounds is never refused later (tests/test_fuzz.py throws generated values at them).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=INT32_MAX)]
NonNegInt = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]


class Sampling(Struct, frozen=True, forbid_unknown_fields=True):
    """Sampling values of one request; the config's `sampling:` block has the same fields."""

    n: PositiveInt = 4
    """Samples per prompt: a GRPO group, which runs on one engine."""
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    """Sampling temperature, in vLLM's range; 0: greedy."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this."""
    top_k: NonNegInt = 0
    """Sample from the k most likely tokens; 0: all tokens."""
    max_tokens: PositiveInt = 128
    """Generated tokens per sample, at most."""
    min_tokens: NonNegInt = 0
    """Generated tokens per sample before a stop token or string may end it."""
    stop_token_ids: list[NonNegInt] = msgspec.field(default_factory=lambda: [2])
    """Token ids that end a sample (the tiny model's `<eos>` is 2)."""
    stop: list[str] = msgspec.field(default_factory=list)
    """Stop strings (they need a tokenizer in the model directory)."""
    seed: Int64 | None = None
    """When set, each sample gets a seed derived from (seed, prompt id, sample index): reproducible
    samples."""
    logprobs: Literal["processed", "raw"] = "processed"
    """The behaviour logprob that travels with each token. `processed`: of the distribution sampled
    from (temperature, top-k/top-p, min_tokens applied); `raw`: log_softmax of the model's logits.
    Engine-wide (vLLM's `logprobs_mode`): a prompt's own sampling cannot change it."""

    def __post_init__(self) -> None:
        if math.isnan(self.temperature):  # Meta(ge=0) already rejects NaN; keep the reason explicit
            raise ValueError("temperature: must be a number >= 0, got NaN")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        for i, stop in enumerate(self.stop):
            if not stop:  # vLLM refuses it in each request ("stop cannot contain an empty string"): say so once, here
                raise ValueError(f"stop[{i}]: empty, a stop string needs at least one character")
            if (reason := not_utf8(stop)) is not None:
                raise ValueError(f"stop: [{i}] {reason}")


def not_utf8(text: str) -> str | None:
    """Why `text` cannot travel as UTF-8 (msgpack, JSON, the tokenizer): a lone surrogate; None if it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid UTF-8: lone surrogate {text[e.start]!r} at character {e.start}"
    return None


def not_utf8_in(value: Any, where: str) -> str | None:
    """The first string (a key or a value, at any depth of dicts and lists) in `value` that is not
    valid UTF-8, as "where.key: reason"; None when every one is."""
    if isinstance(value, (dict, list, tuple)):
        # msgspec's encoder checks every string in C (a prompt's 1k token ids: ~2 us, not ~40 us in
        # Python); only a value it refuses, for a bad string or a type it cannot encode, is walked
        try:
            msgspec.msgpack.encode(value)
            return None
        except Exception:
            pass
    return _walk(value, where)


def _walk(value: Any, where: str) -> str | None:
    if isinstance(value, str):
        return None if (reason := not_utf8(value)) is None else f"{where}: {reason}"
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{where}.{key}" if isinstance(key, str) and not_utf8(key) is None else where
            if (found := _walk(key, f"{where} key") or _walk(item, name)) is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if type(item) is not int and (found := _walk(item, f"{where}[{i}]")) is not None:  # token ids: skipped fast
                return found
    return None


def printable(text: Any) -> str:
    """`text` as a str that encodes (lone surrogates escaped): for ids and messages that must travel."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


class Prompt(Struct, frozen=True, forbid_unknown_fields=True):
    """One prompt. Give `token_ids` (checked up front) or `text` (tokenized by the engine).

    `sampling` overrides fields of the configured sampling for this prompt only, e.g.
    `{"max_tokens": 16}`. `metadata` is carried through untouched (reward functions see it).
    """

    token_ids: list[int] | None = None
    text: str | None = None
    id: str = ""
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    # A conversation's turns share a session (n=1): each runs on the engine of the turn before and
    # reuses the KV it left (`Trajectory.kv_reused`), as an episode's turns do.
    session: str | None = None


class Request(Struct, frozen=True):
    """One sample of one prompt, as sent to an engine.

    `resume`: what an engine that died had generated of this sample (its last progress report);
    the new engine continues from there, as prompt + those tokens, recomputing their KV.
    """

    request_id: str
    prompt_id: str
    sample_index: int
    sampling: Sampling
    token_ids: list[int] | bytes | None = None  # packed (a trajectory's `TokenIds` fed again) or a list
    text: str | None = None
    resume: Trajectory | None = None
    # An episode's turn: the prefix-cache salt its episode's turns share, so this turn reuses the
    # KV the turns before computed (`Trajectory.kv_reused`); None: salted with the epoch.
    cache_salt: str | None = None
    # Streamed: the engine sends its new tokens after every step (`Delta`), not only when it ends.
    stream: bool = False

    def __post_init__(self) -> None:
        if type(self.token_ids) is bytes:  # decoded packed: typed again
            msgspec.structs.force_setattr(self, "token_ids", unpack(self.token_ids, TokenIds, "token_ids"))


class Trajectory(Struct):
    """One finished sample. `logprobs[i]` is the behaviour logprob of `token_ids[i]`.

    Per-token data is packed (`rollout.packed`): an engine's trajectories hold `TokenIds` and
    `Logprobs`, typed arrays that read as the lists they were (a Trajectory built by hand keeps the
    sequences it was given, lists by default); packed, they cross the wire as msgpack bins (encode
    with `rollout.packed.encode` / `to_json`) and decode from those or from lists (JSON, older data)."""

    request_id: str = ""
    prompt_id: str = ""
    sample_index: int = 0
    prompt_token_ids: list[int] | bytes = msgspec.field(default_factory=list)
    token_ids: list[int] | bytes = msgspec.field(default_factory=list)
    logprobs: list[float] | bytes = msgspec.field(default_factory=list)
    finish_reason: FinishReason = "stop"
    error: str | None = None
    policy_epochs: list[tuple[int, int]] = msgspec.field(default_factory=list)
    kv_epochs: list[tuple[int, int]] = msgspec.field(default_factory=list)
    kv_recomputes: list[tuple[int, int]] = msgspec.field(default_factory=list)
    num_preemptions: int = 0  # times the KV was dropped and recomputed (== len(kv_recomputes))
    engine_id: int = -1
    # unix times (s): admitted by the scheduler, sent to the engine, first token, finished
    queued_at: float = 0.0
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    reward: float | None = None
    stale_tokens: int = 0  # leading generated tokens masked out of the loss as too stale (staleness.stale: mask)
    # Episodes (docs/guides/episodes.md). Of a turn: `kv_reused` leading prompt positions kept the KV
    # the episode's turns before computed (as their `kv_epochs` say); the rest was computed by its
    # first step. `cache_salt`: the prefix-cache salt its KV is held under (the next turn's).
    kv_reused: int = 0
    cache_salt: str = ""
    # Of a whole episode: `token_ids` is every token after the first prompt (model turns and
    # observations), `logprobs` 0.0 and `loss_mask` 0 on observation tokens, `policy_epochs` -1 runs
    # there; `turns` holds each model turn (prompt = the conversation so far) with its own records.
    loss_mask: list[int] = msgspec.field(default_factory=list)  # empty: every token is the model's
    turns: list[Trajectory] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:  # decoded from packed bytes: typed arrays again
        if type(self.token_ids) is bytes or type(self.prompt_token_ids) is bytes or type(self.logprobs) is bytes:
            self.prompt_token_ids = unpack(self.prompt_token_ids, TokenIds, "prompt_token_ids")
            self.token_ids = unpack(self.token_ids, TokenIds, "token_ids")
            self.logprobs = unpack(self.logprobs, Logprobs, "logprobs")

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"

    def token_epochs(self) -> list[int]:
        """The policy epoch of every generated token."""
        return expand_runs(self.policy_epochs, len(self.token_ids))

    @property
    def epoch_span(self) -> tuple[int, int] | None:
        """(oldest, newest) policy epoch among the generated tokens; None without tokens."""
        if not self.policy_epochs or not self.token_ids:
            return None
        epochs = [e for _, e in self.policy_epochs]
        return min(epochs), max(epochs)


class Group(Struct):
    """The `n` samples of one prompt. `error` is set when the prompt itself was rejected."""

    prompt_id: str
    prompt: Prompt
    trajectories: list[Trajectory] = msgspec.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(t.ok for t in self.trajectories)


class GroupResult(Struct):
    """An engine's answer for one group it was handed (`key`): its trajectories, or why it has none
    (`dead`: the engine died, so the samples may continue elsewhere)."""

    key: str = ""
    trajectories: list[Trajectory] = msgspec.field(default_factory=list)
    error: str | None = None
    dead: bool = False


class Delta(Struct, array_like=True):
    """What a streamed sample (`Request.stream`) generated since its engine's last step, exact: its
    tokens and logprobs from position `start` on (`sample.token_ids`, `sample.logprobs`), and its
    epoch records so far whole (`policy_epochs`, `kv_recomputes`, `kv_reused`, `cache_salt`,
    `first_token_at`), as a progress report keeps them. Only tokens the engine keeps are sent: a
    delta never shows a token its finished trajectory lacks. `key`: its group on the data path."""

    key: str
    start: int
    sample: Trajectory


class ProgressReport(Mapping[str, "Trajectory"]):
    """An engine's progress report, request id -> `Trajectory` so far, decoded on first read.

    Engines report every few seconds and a report is read only if its engine fails, so the
    msgpack bytes (`list[Trajectory]`) are kept as they came.
    """

    def __init__(self, data: bytes):
        self._data = data
        self._by_id: dict[str, Trajectory] | None = None

    def _decoded(self) -> dict[str, Trajectory]:
        if self._by_id is None:
            self._by_id = {t.request_id: t for t in msgspec.msgpack.decode(self._data, type=list[Trajectory])}
        return self._by_id

    def __getitem__(self, request_id: str) -> Trajectory:
        return self._decoded()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())


class EngineStats(Struct):
    engine_id: int = -1
    epoch: int = 0
    running: int = 0
    requests_finished: int = 0
    tokens_generated: int = 0
    requests_failed: int = 0
    reruns: int = 0  # requests rerun because a weight update overtook their prompt
    preemptions: int = 0  # requests vLLM evicted for KV cache (each continued as a new request, recorded)


class SpecCounters(Struct):
    """One engine's speculative decoding counts: cumulative since it started, or over a window."""

    engine_id: int = 0
    num_speculative_tokens: int = 0  # 0: this engine does not speculate
    drafts: int = 0  # verification steps of a request that had draft tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)  # [i]: drafts whose token i was accepted

    def add(self, drafts: int, draft_tokens: int, accepted_tokens: int, accepted_per_pos: Sequence[int]) -> None:
        """Count one engine step (vLLM's SpecDecodingStats of that step)."""
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens
        mine, step = self.accepted_per_pos, accepted_per_pos
        self.accepted_per_pos = [
            (mine[i] if i < len(mine) else 0) + (step[i] if i < len(step) else 0)
            for i in range(max(len(mine), len(step)))
        ]


class UpdateStats(Struct):
    """One weight update: what moved and what each engine's requests saw."""

    epoch: int
    mode: str
    bytes: int = 0  # size of the weights (moved once into the object store)
    bytes_received: int = 0  # summed over engines
    seconds: float = 0.0  # phase 2: from the first engine's pause to the last engine's resume
    prepare_s: float = 0.0  # before it: checks, the object store's receive or the plane's join
    stall_s: dict[int, float] = msgspec.field(default_factory=dict)  # engine -> pause..resume
    load_s: dict[int, float] = msgspec.field(default_factory=dict)  # engine -> weight load alone
    # engine -> KV positions its running requests had to recompute (recompute, abort_resume)
    recomputed_tokens: dict[int, int] = msgspec.field(default_factory=dict)
    failed: list[int] = msgspec.field(default_factory=list)
