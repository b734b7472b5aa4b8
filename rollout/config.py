"""Typed experiment config: a tree of msgspec Structs loaded from YAML in one call.

Owns: every default (here and nowhere else), unknown-key rejection, `a.b=c` overrides, cross-field
checks, and error messages that name the offending key path (`engines.count: expected int >= 1`).
Each key's meaning is the string under its field: docs/gen_reference.py renders them, with each
key's type, default and range, into the config reference (docs/reference/config.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.yaml
from msgspec import Meta, Struct

from rollout.config_files import config_path
from rollout.errors import InvalidConfigError
from rollout.speculative import SpeculativeConfig, check_raw_speculative_args
from rollout.types import NonNegInt, PositiveInt, Sampling, not_utf8_in, printable

PositiveFloat = Annotated[float, Meta(gt=0.0)]


class ModelConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The model every engine serves."""

    path: str = "tiny"
    """`tiny`: the embedded random-weight Llama, built locally; else a local HF model directory."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """The weights' dtype in the engines."""
    max_model_len: PositiveInt = 2048
    """Prompt plus generated tokens of one request."""
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] = 0
    """Seeds the tiny model's weights and vLLM's sampler (numpy takes 32 bits)."""


class EnginesConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The vLLM engines: how many, their resources, health, restarts and retries."""

    count: PositiveInt = 2
    """vLLM engines, one Ray actor each."""
    cpus_per_engine: PositiveInt = 1
    """Ray CPUs per engine. A CPU engine runs on that many cores of its own: its engine core and
    worker processes, and its OpenMP threads, are pinned there (the engine actor's front-end is not)."""
    gpus_per_engine: Annotated[float, Meta(ge=0)] = 0
    """Ray GPUs per engine (below 1: engines share a GPU)."""
    max_inflight_per_engine: PositiveInt = 256
    """Requests one engine runs at once (vLLM's `max_num_seqs`)."""
    queued_per_engine: PositiveInt | None = None
    """Requests the scheduler hands an engine beyond its running batch, waiting in vLLM's own
    queue, so the step after a request ends already runs its successor instead of one
    engine-driver round trip later. It must cover what finishes within a round trip (on the tiny
    model a whole batch ends together); fewer lets each wave drain the engine. At most
    `max_inflight_per_engine`; null: as many. The router counts them as load."""
    start_timeout_s: PositiveFloat = 600.0
    """Engines must be ready within this."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement group strategy for the engine bundles."""
    health_interval_s: PositiveFloat = 2.0
    """How often each engine reports its requests' progress (what a crash would keep)."""
    health_timeout_s: PositiveFloat = 60.0
    """An engine silent this long is killed; its requests move on."""
    max_restarts: NonNegInt = 3
    """Restarts per engine; the n-th waits `restart_backoff_s * 2**(n-1)`."""
    restart_backoff_s: Annotated[float, Meta(ge=0)] = 1.0
    """The first restart's wait; each later one doubles it."""
    request_timeout_s: PositiveFloat | None = None
    """A group with no result by then moves to another engine; null: no limit."""
    max_retries: NonNegInt = 3
    """Times a group's unfinished samples move to another engine before they fail."""
    preemption: Literal["record", "avoid"] = "record"
    """vLLM preempts a running request when its KV cache runs out. `record`: let it, and record
    each preemption (the request continues as a new one; `kv_recomputes` gets the recompute).
    `avoid`: cap running requests at what the cache holds at `max_model_len`, so it never has to."""
    vllm: dict[str, Any] = msgspec.field(default_factory=dict)
    """Pass-through vLLM engine args (any `AsyncEngineArgs` field; `logprobs_mode` and
    `scheduler_cls` are rollout's; `scheduling_policy: priority` runs the longest remaining token
    budget first), plus `kv_cache_gib`: the KV cache per engine. Default: 1 GiB on CPU engines;
    on GPU engines vLLM's own sizing by `gpu_memory_utilization` (engines sharing a GPU get their
    share of 0.9)."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting in each engine's queue beyond its running batch (`queued_per_engine`)."""
        return self.max_inflight_per_engine if self.queued_per_engine is None else self.queued_per_engine

    def __post_init__(self) -> None:
        q = self.queued_per_engine
        if q is not None and q > self.max_inflight_per_engine:
            raise ValueError(
                f"queued_per_engine: {q} exceeds engines.max_inflight_per_engine {self.max_inflight_per_engine} "
                "(vLLM's max_num_seqs): a queue deeper than the batch it refills only holds requests back "
                "from other engines"
            )


class PromptsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The prompts `rollout bench` and `rollout run` generate from."""

    source: Literal["synthetic", "jsonl"] = "synthetic"
    """`synthetic`: random tokens; `jsonl`: the file at `path`."""
    path: str | None = None
    """With `source: jsonl`: one Prompt object per line."""
    count: PositiveInt = 512
    """Synthetic prompts."""
    min_len: PositiveInt = 16
    """Synthetic prompts' shortest length in tokens (lengths are uniform in [min_len, max_len])."""
    max_len: PositiveInt = 128
    """Synthetic prompts' longest length in tokens."""
    seed: int = 0
    """Seeds the synthetic prompts."""

    def __post_init__(self) -> None:
        if self.source == "jsonl" and not self.path:
            raise ValueError("path: required when source is 'jsonl'")
        if self.min_len > self.max_len:
            raise ValueError(f"min_len: {self.min_len} exceeds max_len {self.max_len}")


class WeightSyncConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """What `update_weights` does to the engines."""

    mode: Literal["keep", "recompute", "abort_resume", "drain"] = "keep"
    """What running requests do at an update. `keep`: pause, load, resume; they continue over their
    old KV (fastest). `recompute`: as keep, but they recompute their KV with the new weights.
    `abort_resume`: they are aborted and continue as prompt + partial output. `drain`: stop
    starting requests, let running ones finish, then load (the synchronous baseline)."""
    timeout_s: PositiveFloat = 300.0
    """One engine's pause + load + resume; past it the engine leaves rotation."""


class StalenessConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """How stale a handed-out token may be. A token's lag is the epoch when its trajectory is
    handed out minus the token's policy epoch."""

    max_lag: NonNegInt | None = None
    """The largest lag in epochs of a handed-out token; null: unbounded; 0 with
    `weight_sync.mode: drain`: synchronous RL."""
    stale: Literal["drop", "mask"] = "drop"
    """What hand-out does with a trajectory that has tokens lagging more: `drop` it (a group left
    with none is not handed out), or `mask` those tokens out of the loss."""
    batch_groups: PositiveInt | None = None
    """Groups the learner consumes per weight update, for admission; wins over
    `batches(groups=k)`. Null: the `groups` of the latest `batches(groups=k)` call (`groups()`
    counts as 1)."""


class QueueConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The queue of finished groups between the engines and the learner."""

    max_groups: PositiveInt | None = None
    """Groups admitted but not yet taken by the learner; a full queue stops admission. Null: twice
    what the engines hold running and queued, `2 x engines.count x (max_inflight_per_engine +
    queued_per_engine) / sampling.n`, since a group keeps its slot until its last sample ends
    (`configs/tiny.yaml`: 512). Admitted groups wait for an engine largest `max_tokens` first, so
    the more it admits, the further ahead the long ones are seen."""
    order: Literal["ready_first", "in_order"] = "ready_first"
    """`ready_first`: groups are handed out as they finish; `in_order`: in the order they were fed."""
    durable_dir: str | None = None
    """When set, finished groups are logged here (fsync'd) before hand-out and acknowledged when
    the learner commits them; a new engine on the same directory hands out the uncommitted ones
    first and resumes at the latest epoch. One run per directory (it is locked)."""
    durable_commit: Literal["auto", "explicit"] = "auto"
    """`auto`: asking for the next group or batch commits the ones handed out before (so does a
    clean exit); `explicit`: only `engine.commit()` does (a learner that fetches ahead)."""
    durable_compact_bytes: PositiveInt = 64 << 20
    """The log is rewritten with only the uncommitted groups once committed records take this many
    bytes."""


class EpisodeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Limits of a multi-turn episode (with `env` set)."""

    max_turns: PositiveInt = 8
    """Model turns per episode."""
    max_tokens: PositiveInt | None = None
    """Tokens of the whole conversation; null: `model.max_model_len`."""
    step_timeout_s: PositiveFloat | None = 60.0
    """One `reset` or `step` of the environment, timed from when it starts running (a sync one's
    wait for a worker thread does not count); null: no limit."""


class ServeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """`rollout serve` / `engine.serve()`: the OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    """The address to listen on: loopback unless told otherwise."""
    port: NonNegInt = 8000
    """The port; 0: a free one."""
    api_key: str | None = None
    """When set, every request needs `Authorization: Bearer <key>`."""
    model_name: str | None = None
    """The model id clients send; null: `model.path`."""
    max_concurrency: PositiveInt = 1024
    """Requests in flight per front-end process; past it: 429."""
    api_servers: Annotated[int, Meta(ge=1, le=64)] = 1
    """HTTP front-end processes sharing the port (vLLM's `--api-server-count`); 1: the server runs
    in the engine's process."""
    max_body_bytes: PositiveInt = 8 * 2**20
    """The largest request body; past it: 413."""
    tool_parser: str | None = "hermes"
    """vLLM's tool-call parser by the name it registers (`vllm serve --tool-call-parser`), for
    served chats and episodes' actions; `none` or null: none."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser by the name it registers (e.g. `qwen3`, `deepseek_r1`); `none` or
    null: none."""

    def __post_init__(self) -> None:
        if self.tool_parser not in (None, "none", "hermes") or self.reasoning_parser not in (None, "none"):
            from rollout.parsers import check_names  # imports vLLM: only for a name not known here

            check_names(self.tool_parser, self.reasoning_parser)


class RayConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The Ray cluster the engines run in."""

    address: str | None = None
    """Null: start a local cluster (loopback only, token auth); `auto`, `host:port` or
    `ray://host:port`: join an existing one (checked to answer within 5 s)."""
    num_cpus: PositiveInt | None = None
    """The local cluster's CPUs; null: enough for the engines."""


class LoggingConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The engine's own log lines, and where those of the libraries under it (vLLM, Ray, torch) go."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """The lowest level logged."""
    json: bool = False
    """JSON lines instead of console text (`--log-json`)."""
    verbose: bool = False
    """vLLM's, Ray's and torch's output on the console, as they print it (`-v`; `level: debug` implies it)."""
    dir: str = "rollout-logs"
    """Otherwise it goes to files here: a folder per engine start (`<date>-<time>-<pid>/`); errors show too."""


class MetricsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The Prometheus exporter; `engine.metrics()` needs nothing here."""

    port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    """Serve `/metrics` on this port; null: off; 0: any free port."""
    host: str = "127.0.0.1"
    """Loopback only; `0.0.0.0` lets other machines scrape it."""
    refresh_s: PositiveFloat = 5.0
    """How often the exporter reads each engine's own counters (preemptions, speculative decoding)."""


_BENCH_ROUNDS = 4


class BenchConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """`rollout bench`: this engine against raw vLLM on the same engines."""

    baseline: bool = True
    """Also drive raw vLLM with the same prompts and report the ratio."""
    warmup_prompts: NonNegInt | None = None
    """Warm-up prompts; null: enough to fill every engine once (no batch shape compiles mid-run)."""
    rounds: PositiveInt = _BENCH_ROUNDS
    """Rounds of (this engine, raw vLLM), order alternating; the ratio is their median (`--rounds
    N`). 4 keeps a first run within minutes; 12 gives a 96% interval that excludes the 2 extreme
    rounds each side."""
    repeats: PositiveInt | None = None
    """Another name for `rounds`, read from configs that use it."""
    report: str = "bench_report.json"
    """The JSON report's path (`--report`)."""

    def __post_init__(self) -> None:
        if self.repeats is not None:
            if self.rounds != _BENCH_ROUNDS and self.rounds != self.repeats:
                raise ValueError(
                    f"repeats: the old name of rounds; give one of them, not repeats {self.repeats} "
                    f"and rounds {self.rounds}"
                )
            msgspec.structs.force_setattr(self, "rounds", self.repeats)


class Config(Struct, frozen=True, forbid_unknown_fields=True):
    """One experiment: a YAML file of these sections, each key optional (`load_config`)."""

    model: ModelConfig = ModelConfig()
    engines: EnginesConfig = EnginesConfig()
    sampling: Sampling = Sampling()
    prompts: PromptsConfig = PromptsConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    staleness: StalenessConfig = StalenessConfig()
    queue: QueueConfig = QueueConfig()
    reward: str | None = None
    """`package.module:function`, `(prompt, trajectory) -> float`, sync or async, called once per
    trajectory off the engine path; an exception or a non-finite value fails that trajectory only.
    `to_tensors()` then adds `rewards` and GRPO `advantages`. `RolloutEngine(cfg, reward=fn)`
    passes one in code."""
    env: str | None = None
    """Multi-turn episodes: `package.module:Class` (reset/step), built with `env_args`, one per
    episode; each sample of a prompt is then an episode of model turns and environment steps.
    `RolloutEngine(cfg, env=...)` passes one in code."""
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword arguments the environment class is built with."""
    episode: EpisodeConfig = EpisodeConfig()
    serve: ServeConfig = ServeConfig()
    ray: RayConfig = RayConfig()
    logging: LoggingConfig = LoggingConfig()
    bench: BenchConfig = BenchConfig()
    metrics: MetricsConfig = MetricsConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        check_raw_speculative_args(self.engines.vllm)
        if self.queue.max_groups is None:
            e = self.engines
            groups = -(-2 * e.count * (e.max_inflight_per_engine + e.queue_depth) // self.sampling.n)
            msgspec.structs.force_setattr(self, "queue", msgspec.structs.replace(self.queue, max_groups=groups))
        if self.sampling.n > self.engines.max_inflight_per_engine:
            raise ValueError(
                f"sampling.n: {self.sampling.n} exceeds engines.max_inflight_per_engine "
                f"{self.engines.max_inflight_per_engine} (a group runs on one engine)"
            )
        k = self.staleness.batch_groups
        if k is not None and k > self.queue.max_groups:
            raise ValueError(f"staleness.batch_groups: {k} can never fill, queue.max_groups is {self.queue.max_groups}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply `a.b=value` overrides.

    `path` is a packaged config's name (`load_config("tiny")`: `configs/tiny.yaml`, shipped in the
    wheel) or a file's path. Override values are parsed as YAML (`-o sampling.n=8`,
    `-o sampling.stop=['\\n']`). Raises InvalidConfigError naming the key path; FileNotFoundError for
    a missing file or an unknown name.
    """
    raw: Any = {}
    if path is not None:
        text = config_path(path).read_bytes()
        try:
            raw = msgspec.yaml.decode(text) or {}
        except msgspec.DecodeError as e:
            raise InvalidConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidConfigError(f"{path}: expected a mapping at the top level")
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    if (bad := not_utf8_in(raw, "")) is not None:  # msgspec would raise UnicodeEncodeError naming nothing
        raise InvalidConfigError(bad.lstrip("."))
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise InvalidConfigError(readable_validation_error(e)) from e


def readable_validation_error(e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int` >= 1, got `0` - at `$.engines.count`" -> "engines.count: ..."."""
    msg = str(e)
    m = re.match(r"^(.*?)(?: - at `\$(.*)`)?$", msg, re.S)
    assert m is not None
    what, where = m.group(1), (m.group(2) or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"{key}: unknown key"
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        key = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return f"{key}: required key is missing"
    # __post_init__ errors come as "field: reason" of the struct at `where`.
    field = re.match(r"^([\w.]+(?:\[\d+\])?): (.*)$", what, re.S)  # "stop[1]: ..." names an item
    if field:
        key = f"{where}.{field.group(1)}" if where else field.group(1)
        return f"{key}: {field.group(2)}"
    what = what[:1].lower() + what[1:]
    return f"{where or '<top>'}: {what}"


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise InvalidConfigError(f"override {printable(item)!r}: expected key.path=value")
    if (bad := not_utf8_in(value, f"{printable(key)}: override value")) is not None:
        raise InvalidConfigError(bad)
    try:
        parsed = msgspec.yaml.decode(value.encode()) if value.strip() else None
    except msgspec.DecodeError as e:
        raise InvalidConfigError(f"{key}: cannot parse override value {value!r}: {e}") from e
    node = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise InvalidConfigError(f"{'.'.join(parts[: i + 1])}: is not a mapping, cannot set {key}")
        node = child
    node[parts[-1]] = parsed


def dump_config(cfg: Config) -> str:
    return msgspec.yaml.encode(cfg).decode()
