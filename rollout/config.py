"""Typed experiment config: a tree of msgspec Structs loaded from YAML in one call.

Owns: every default (here and nowhere else), unknown-key rejection, `a.b=c` overrides, cross-field
checks, and error messages that name the offending key path (`engines.count: expected int >= 1`).
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.yaml
from msgspec import Meta, Struct

from rollout.errors import InvalidConfigError
from rollout.types import NonNegInt, PositiveInt, Sampling, not_utf8_in, printable

PositiveFloat = Annotated[float, Meta(gt=0.0)]


class ModelConfig(Struct, frozen=True, forbid_unknown_fields=True):
    path: str = "tiny"  # "tiny": the embedded random-weight Llama; else a local HF model dir
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: PositiveInt = 2048
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] = (
        0  # seeds the tiny model's weights and vLLM's sampler (numpy: 32 bits)
    )


class EnginesConfig(Struct, frozen=True, forbid_unknown_fields=True):
    count: PositiveInt = 2
    cpus_per_engine: PositiveInt = 1  # CPU engines also get this many OpenMP threads, pinned
    gpus_per_engine: Annotated[float, Meta(ge=0)] = 0
    max_inflight_per_engine: PositiveInt = 256  # requests one engine runs at once (vLLM's max_num_seqs)
    # ...and requests the scheduler hands it beyond those, waiting in vLLM's own queue: the step
    # after a request ends already runs its successor, instead of one engine-driver round trip
    # later. It must cover what finishes within a round trip: on the tiny model a whole batch
    # ends together (every sample runs to max_tokens). 1 to max_inflight_per_engine; None: as
    # many as max_inflight_per_engine (`queue_depth`).
    queued_per_engine: PositiveInt | None = None
    start_timeout_s: PositiveFloat = 600.0
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Health: every interval each engine reports its requests' progress (what a crash would keep);
    # an engine that does not answer within health_timeout_s is killed and its requests move on.
    health_interval_s: PositiveFloat = 2.0
    health_timeout_s: PositiveFloat = 60.0
    max_restarts: NonNegInt = 3  # per engine; the n-th restart waits restart_backoff_s * 2**(n-1)
    restart_backoff_s: Annotated[float, Meta(ge=0)] = 1.0
    request_timeout_s: PositiveFloat | None = None  # a group with no result by then is retried elsewhere
    max_retries: NonNegInt = 3  # times a group's unfinished samples move to another engine, then fail
    # vLLM preempts a running request when its KV cache runs out. record: let it, and record each
    # preemption (the request continues as a new one; `kv_recomputes` gets the recompute); avoid:
    # cap running requests at what the cache holds at max_model_len, so it never has to.
    preemption: Literal["record", "avoid"] = "record"
    # Pass-through vLLM engine args (any AsyncEngineArgs field), plus `kv_cache_gib` (the KV cache
    # size; default on CPU engines: 1 GiB; on GPU engines vLLM sizes it by gpu_memory_utilization).
    vllm: dict[str, Any] = msgspec.field(default_factory=dict)

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
    source: Literal["synthetic", "jsonl"] = "synthetic"
    path: str | None = None  # for jsonl: one Prompt object per line
    count: PositiveInt = 512  # synthetic only
    min_len: PositiveInt = 16
    max_len: PositiveInt = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source == "jsonl" and not self.path:
            raise ValueError("path: required when source is 'jsonl'")
        if self.min_len > self.max_len:
            raise ValueError(f"min_len: {self.min_len} exceeds max_len {self.max_len}")


class WeightSyncConfig(Struct, frozen=True, forbid_unknown_fields=True):
    # keep: pause, load, resume; running requests continue over their old KV (fastest)
    # recompute: as keep, but running requests recompute their KV with the new weights
    # abort_resume: running requests are aborted and continue as prompt + partial output
    # drain: stop starting requests, let running ones finish, then load (synchronous baseline)
    mode: Literal["keep", "recompute", "abort_resume", "drain"] = "keep"
    timeout_s: PositiveFloat = 300.0  # one engine's pause + load + resume; past it the engine is dropped


class StalenessConfig(Struct, frozen=True, forbid_unknown_fields=True):
    # Lag of a token = the epoch when its trajectory is handed out - the token's policy epoch.
    max_lag: NonNegInt | None = None  # None: unbounded; 0: synchronous (with weight_sync.mode=drain)
    # What hand-out does with a trajectory that still has tokens lagging more than max_lag:
    # drop it (a group left with none is not handed out), or mask those tokens out of the loss.
    stale: Literal["drop", "mask"] = "drop"
    # Groups the learner consumes per weight update, for admission control. None: the `groups`
    # of the latest `batches(groups=k)` call (`groups()` counts as 1).
    batch_groups: PositiveInt | None = None


class QueueConfig(Struct, frozen=True, forbid_unknown_fields=True):
    # Groups admitted but not yet taken by the learner. None: twice what the engines hold running and
    # queued, engines.count x (max_inflight_per_engine + queued_per_engine) / sampling.n, since a
    # group keeps its slot until its last sample ends; resolved by `Config`.
    max_groups: PositiveInt | None = None
    # ready_first: groups are handed out as they finish; in_order: in the order they were fed
    order: Literal["ready_first", "in_order"] = "ready_first"
    # When set: finished groups are logged here (fsync'd) before hand-out and acknowledged when the
    # learner commits them; a new engine on the same directory hands out the uncommitted ones first
    # and resumes at the latest epoch. One run per directory (it is locked).
    durable_dir: str | None = None
    # auto: asking for the next group or batch commits the ones handed out before (so does a clean
    # exit); explicit: only `engine.commit()` does (a learner that fetches ahead of its step).
    durable_commit: Literal["auto", "explicit"] = "auto"
    # The log is rewritten with only the uncommitted groups once committed records take this much.
    durable_compact_bytes: PositiveInt = 64 << 20


class EpisodeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Limits of a multi-turn episode (with `env` set)."""

    max_turns: PositiveInt = 8  # model turns
    max_tokens: PositiveInt | None = None  # the whole conversation's tokens; null: model.max_model_len
    step_timeout_s: PositiveFloat | None = 60.0  # one `reset` or `step` of the environment


class ServeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """`rollout serve` / `engine.serve()`: the OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: NonNegInt = 8000  # 0: a free port
    api_key: str | None = None  # when set, every request needs `Authorization: Bearer <key>`
    model_name: str | None = None  # the model id clients send; default: model.path
    max_concurrency: PositiveInt = 1024  # requests in flight per front-end process; past it: 429
    # HTTP front-end processes sharing the port (vLLM's --api-server-count); 1: the server runs in the
    # engine's process. Each serves ~1,000 requests/s on a core of its own (README, "Past one driver").
    api_servers: Annotated[int, Meta(ge=1, le=64)] = 1
    max_body_bytes: PositiveInt = 8 * 2**20
    # vLLM's parsers by the names it registers (`vllm serve --tool-call-parser` / `--reasoning-parser`);
    # "none" or null: none. Checked against vLLM's registries here (`policies.parsers`).
    tool_parser: str | None = "hermes"  # how tool calls are read from the model's text
    reasoning_parser: str | None = None  # how reasoning is split from the answer (e.g. qwen3, deepseek_r1)

    def __post_init__(self) -> None:
        if self.tool_parser not in (None, "none", "hermes") or self.reasoning_parser not in (None, "none"):
            from policies.parsers import check_names  # imports vLLM: only for a name not known here

            check_names(self.tool_parser, self.reasoning_parser)


class RayConfig(Struct, frozen=True, forbid_unknown_fields=True):
    address: str | None = None  # None: start a local cluster; "auto" or "host:port": join one
    num_cpus: PositiveInt | None = None  # local cluster only; default: enough for the engines


class LoggingConfig(Struct, frozen=True, forbid_unknown_fields=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False


class MetricsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    # `engine.metrics()` needs nothing here; this is the Prometheus exporter (rollout.metrics.figures).
    port: Annotated[int, Meta(ge=0, le=65535)] | None = None  # serve /metrics on it; None: off; 0: any free port
    host: str = "127.0.0.1"  # loopback only; "0.0.0.0" lets other machines scrape it
    refresh_s: PositiveFloat = (
        5.0  # how often the exporter reads each engine's own counters (preemptions, spec decoding)
    )


_BENCH_ROUNDS = 4


class BenchConfig(Struct, frozen=True, forbid_unknown_fields=True):
    baseline: bool = True  # also drive raw vLLM with the same prompts and report the ratio
    warmup_prompts: NonNegInt | None = None  # None: enough to fill every engine once (no batch shape compiles mid-run)
    # Rounds of (this engine, raw vLLM), order alternating; the ratio is their median. 4 keeps a
    # first `make bench` within minutes; 12 gives a 96% interval that excludes the 2 extreme rounds each side.
    rounds: PositiveInt = _BENCH_ROUNDS
    repeats: PositiveInt | None = None  # the old name of `rounds`, still read (configs written before)
    report: str = "bench_report.json"

    def __post_init__(self) -> None:
        if self.repeats is not None:
            if self.rounds != _BENCH_ROUNDS and self.rounds != self.repeats:
                raise ValueError(
                    f"repeats: the old name of rounds; give one of them, not repeats {self.repeats} "
                    f"and rounds {self.rounds}"
                )
            msgspec.structs.force_setattr(self, "rounds", self.repeats)


# --- Speculative decoding -------------------------------------------------------------------
# vLLM 0.32's `SpeculativeMethod` (vllm/config/speculative.py), so a typo fails when the config
# loads; `policies.vllm_args.engine_args` re-checks against the vLLM actually installed.
SPECULATIVE_METHODS = frozenset(
    {"ngram", "ngram_gpu", "suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator",
     "mtp", "dflash", "dspark", "extract_hidden_states", "custom_class"}
    | {f"{m}_mtp" for m in (
        "deepseek", "dots3_note", "mimo", "mimo_v2", "glm4_moe", "glm4_moe_lite", "glm_ocr", "ernie",
        "nemotron_h", "exaone_moe", "exaone4_5", "qwen3_next", "qwen4_exp", "qwen3_5", "longcat_flash",
        "bailing_hybrid_v3", "minimax_m3", "bailing_hybrid", "kimi_k3", "pangu_ultra_moe", "step3p5",
        "hy_v3", "hy_v4", "gemma4", "inkling", "glm5_next")}
)  # fmt: skip
_NGRAM_METHODS = {"ngram", "ngram_gpu"}  # propose from the context: no model, a token count required
_MODEL_METHODS = {"draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "dflash", "custom_class"}
# Engine args that would set speculation behind this block's back (vLLM's CLI spellings included).
_RAW_SPECULATIVE_ARGS = ("speculative_config", "spec_method", "spec_model", "spec_tokens")


class SpeculativeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding: off while `method` is null; else vLLM's `speculative_config` engine arg.

    `ngram` (prompt lookup) runs on CPU. Draft models, EAGLE heads and MTP pass through for GPU
    engines (`model`: the draft or head directory). `options`: any other field of vLLM's
    SpeculativeConfig, passed as is (names checked against the installed vLLM before engines start).
    """

    method: str | None = None
    num_speculative_tokens: PositiveInt | None = None  # required for ngram; a draft model's config may give it
    prompt_lookup_min: PositiveInt | None = None  # ngram: shortest context n-gram to match
    prompt_lookup_max: PositiveInt | None = None  # ngram: longest
    model: str | None = None  # draft model / EAGLE head directory
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        m = self.method
        if m is None:
            if (
                self.num_speculative_tokens
                or self.prompt_lookup_min
                or self.prompt_lookup_max
                or self.model
                or self.options
            ):
                raise ValueError("method: required when any other speculative key is set (null turns speculation off)")
            return
        if m not in SPECULATIVE_METHODS:
            known = ", ".join(sorted(k for k in SPECULATIVE_METHODS if not k.endswith("_mtp")))
            raise ValueError(f"method: unknown speculative method {m!r}; vLLM 0.32 has {known} and the *_mtp aliases")
        if m in _NGRAM_METHODS and self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens: required for method {m!r}")
        if m in _MODEL_METHODS and not self.model:
            raise ValueError(f"model: required for method {m!r} (the draft model or head directory)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if (lo or hi) and m not in _NGRAM_METHODS:
            raise ValueError(
                f"{'prompt_lookup_min' if lo else 'prompt_lookup_max'}: only for the ngram methods, not {m!r}"
            )
        if lo and hi and lo > hi:
            raise ValueError(f"prompt_lookup_min: {lo} exceeds prompt_lookup_max {hi}")
        for key in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"):
            if key in self.options:
                raise ValueError(f"options.{key}: set speculative.{key} instead")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def vllm_config(self) -> dict[str, Any] | None:
        """vLLM's `speculative_config` engine arg, or None when speculation is off."""
        if self.method is None:
            return None
        typed = {
            k: getattr(self, k)
            for k in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
        }
        return {**{k: v for k, v in typed.items() if v is not None}, **self.options}


def _check_raw_speculative_args(engines: EnginesConfig) -> None:
    """One way in to speculation: raw engine args would bypass these checks and the metrics."""
    for key in _RAW_SPECULATIVE_ARGS:
        if key in engines.vllm:
            raise ValueError(
                f"engines.vllm.{key}: configure speculative decoding in the `speculative:` block "
                "(method, num_speculative_tokens, prompt_lookup_min/max, model; "
                "other vLLM fields under speculative.options)"
            )


class Config(Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig = ModelConfig()
    engines: EnginesConfig = EnginesConfig()
    sampling: Sampling = Sampling()
    prompts: PromptsConfig = PromptsConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    staleness: StalenessConfig = StalenessConfig()
    queue: QueueConfig = QueueConfig()
    reward: str | None = None  # "package.module:function", called once per trajectory
    # Multi-turn episodes: "package.module:Class" (built with env_args, one per episode); each
    # sample of a prompt is then an episode of model turns and environment steps.
    env: str | None = None
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    episode: EpisodeConfig = EpisodeConfig()
    serve: ServeConfig = ServeConfig()
    ray: RayConfig = RayConfig()
    logging: LoggingConfig = LoggingConfig()
    bench: BenchConfig = BenchConfig()
    metrics: MetricsConfig = MetricsConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        _check_raw_speculative_args(self.engines)
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


def packaged_config(name: str) -> Path:
    """A file of the project's `configs/`, from the checkout or an installed wheel (data of the
    `configs` package)."""
    return Path(str(importlib.resources.files("configs").joinpath(name)))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply `a.b=value` overrides.

    Override values are parsed as YAML (`-o sampling.n=8`, `-o sampling.stop=['\\n']`).
    Raises InvalidConfigError naming the key path; FileNotFoundError for a missing file.
    """
    raw: Any = {}
    if path is not None:
        text = Path(path).read_bytes()
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
