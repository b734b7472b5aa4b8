"""NeMo RL's generation interface over `RolloutEngine`, so a NeMo-RL-style trainer can swap it in.

Owns: turning a right-padded batch (`input_ids` [B, S], `input_lengths` [B], optional per-row
`stop_strings`) into one `n=1` prompt per row, routing each finished group back to its row, and
building NeMo RL's output tensors. Row i of the output is row i of the input, always. Does not
own: scheduling, sampling, weights (all `RolloutEngine`'s).

    gen = RolloutGeneration("tiny")                       # starts and owns the engines
    out = gen.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)
    gen.shutdown()

Reaching the engine: a `RolloutEngine` lives on one event loop. Built from a config, this class
starts it on a loop in a thread of its own (as `SyncRolloutEngine` does); given a running engine
(`engine=`), it uses that engine's loop and must be created on it. Blocking methods hop onto that
loop; `agenerate` and `generate_async` run on it directly when awaited there, and otherwise step
through a worker thread, so they work from any loop. Each call submits its rows on a channel of
its own (`RolloutEngine.submit`), so calls may overlap, and a learner may consume the engine's
own queue meanwhile.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec

from rollout.aio import fan_out
from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.errors import RolloutError, WeightSyncError
from rollout.handout.queue import Submission
from rollout.inputs.prompts import effective_sampling
from rollout.learner.nemo_tensors import output_tensors, pad_id_from_model_dir, prompts_from_batch, verify_right_padding
from rollout.log import get_logger
from rollout.types import Group, Prompt, Trajectory

if TYPE_CHECKING:
    from rollout.metrics.live import MetricsWindow
    from rollout.weights.sync_client import WeightSyncClient
    from rollout.weights.transfer import WeightTransfer

__all__ = [
    "GenerationError",
    "RolloutGeneration",
    "output_tensors",
    "pad_id_from_model_dir",
    "prompts_from_batch",
    "verify_right_padding",
]

T = TypeVar("T")
log = get_logger(__name__)
_instances = itertools.count()  # prompt ids differ between facades sharing an engine one after another


class GenerationError(RolloutError):
    """Rows whose sample failed in the engine (finish reason error or abort); `rows`: row -> reason."""

    def __init__(self, message: str, rows: dict[int, str]):
        super().__init__(message)
        self.rows = rows


class RolloutGeneration:
    """NeMo RL's `GenerationInterface` over a `RolloutEngine`. Results are plain dicts of CPU tensors.

    `RolloutGeneration(cfg, **engine_kwargs)` starts a RolloutEngine (blocking, like NeMo RL's
    backends) and `shutdown()` stops it; `RolloutGeneration(engine=engine)` wraps a running one
    (create it on that engine's event loop; `shutdown()` leaves the engine to its owner).
    `pad_value`: the pad id of inputs and outputs; default the model's (tokenizer pad token, else
    config.json `pad_token_id`; the tiny model's is 0). `sampling`: overrides of the configured
    sampling for every row (e.g. `{"max_tokens": 256}`); `n` is always 1, one output row per input row.
    """

    def __init__(
        self,
        cfg: Config | str | Path | None = None,
        *,
        engine: RolloutEngine | None = None,
        pad_value: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        **engine_kwargs: Any,
    ):
        if (cfg is None) == (engine is None):
            raise ValueError("give exactly one of cfg (start an engine) or engine= (wrap a running one)")
        if engine_kwargs and engine is not None:
            raise ValueError(f"engine keyword arguments {sorted(engine_kwargs)} need cfg, not engine=")
        self._sampling = dict(sampling or {})
        if self._sampling.get("n", 1) != 1:
            raise ValueError(f"sampling.n: generation returns one row per input row (n=1), got {self._sampling['n']}")
        self._portal: Any = None
        self._closed = False
        self._lock = threading.Lock()  # guards the call counter: callers' threads use it
        self._calls = itertools.count()
        self._tag = next(_instances)
        self._client: WeightSyncClient | None = (
            None  # vLLM's weight-transfer calls, once init_collective joined the trainer's group
        )
        self._refit: dict[str, Any] | None = None  # prepare_refit_info's: each refit's update info
        self._refit_round = 0
        self._metrics: MetricsWindow | None = None  # get_logger_metrics' window
        owned = engine is None
        self.engine = engine = RolloutEngine(cfg, **engine_kwargs) if owned else engine  # type: ignore[arg-type]
        if not owned:
            engine.limits  # noqa: B018 -- raises EngineClosedError unless the engine is running
        base = engine.cfg.sampling
        effective_sampling(base, Prompt(sampling={**self._sampling, "n": 1}))  # InvalidPromptError names the field
        self._base_stop = [*base.stop, *self._sampling.get("stop", [])]
        if owned:  # start it on a loop in a thread of our own
            self._portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = self._portal_cm.__enter__()
            try:
                self._engine_cm = self._portal.wrap_async_context_manager(engine)
                self._engine_cm.__enter__()
            except BaseException:
                self._portal_cm.__exit__(None, None, None)
                raise
            self._loop_thread = self._portal.call(threading.get_ident)
        else:
            try:
                self._token = anyio.lowlevel.current_token()
            except Exception as e:
                raise RuntimeError("RolloutGeneration(engine=...) must be created on the engine's event loop") from e
            self._loop_thread = threading.get_ident()
        self.pad_value = pad_value if pad_value is not None else pad_id_from_model_dir(engine.model_path)
        if self.pad_value is None:
            self.shutdown()
            raise ValueError(f"the model at {engine.model_path} has no pad token: pass pad_value=")

    def __enter__(self) -> RolloutGeneration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> dict[str, Any]:
        """One sample per row, blocking until every row is done. Returns a plain dict:

        `output_ids` [B, S + longest generation] (prompt then generation, right-padded with
        `pad_value`, the dtype of `input_ids`), `logprobs` (aligned with `output_ids`),
        `generation_lengths`, `unpadded_sequence_lengths`, `truncated`, `token_epochs` (see
        `output_tensors`). A row whose prompt + max_tokens exceeds `model.max_model_len` generates
        what the context has room for (finish reason length, `truncated` True); a row with no room
        at all comes back with its prompt and nothing generated, `truncated` False (as NeMo RL's
        vLLM workers do). Raises InvalidPromptError on bad input, nothing admitted (a batch that
        is not right-padded: verify_right_padding's message); GenerationError naming every failed
        row, once all rows are done; EngineDeadError. Not on the engine's loop (there: `agenerate`).
        """
        self._check_open()
        call = self._prepare(data, greedy)
        return call.tensors(self._blocking(self._run, call.submitted), self.pad_value)

    async def agenerate(self, data: Mapping[str, Any], greedy: bool = False) -> dict[str, Any]:
        """`generate`, awaitable from any event loop."""
        self._check_open()
        call = self._prepare(data, greedy)
        return call.tensors(await self._on_engine(self._run, call.submitted), self.pad_value)

    async def generate_async(
        self, data: Mapping[str, Any], greedy: bool = False
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield `(row index, one-row result)` as each row finishes, every row exactly once.

        A one-row result has `generate`'s keys, width S + its generation. A failed row raises
        GenerationError when it comes up (rows yielded before it stand). Leaving early is fine:
        rows still running are dropped as they finish.
        """
        self._check_open()
        call = self._prepare(data, greedy)
        for i in sorted(call.full):  # no room to generate: nothing to wait for
            yield i, call.tensors({}, self.pad_value, rows=[i])
        if not call.submitted:
            return
        submission = await self._on_engine(self._submit, call.submitted)
        try:
            while (item := await self._on_engine(submission.next)) is not None:
                k, group = item
                yield call.rows[k], call.tensors({k: group}, self.pad_value, rows=[call.rows[k]])
        finally:
            submission.cancel()  # left early: the rows still running stop (a no-op once all came back)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Ready the engines for a generation phase: a no-op, returns True.

        NeMo RL wakes sleeping vLLM engines here (`AsyncLLM.wake_up`). These never sleep: vLLM's
        sleep mode needs CUDA, ROCm or XPU (not CPU), and the engine interface
        (`rollout.scheduling.protocols.Engine`) has no sleep/wake, so the engines stay loaded between phases.
        """
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """End a generation phase: a no-op, returns True (see `prepare_for_generation`).

        NeMo RL also resets the prefix cache here; not needed: cache blocks are salted with the
        weight epoch, so none computed by old weights is reused after `update_weights`.
        """
        return True

    # -- the hooks NeMo RL's GRPO loop calls every step ------------------------------------------

    def blocks_training(self) -> bool:
        """False: the engines run on cores or GPUs of their own and never stand down for a training
        step (they have no sleep mode: see `prepare_for_generation`)."""
        return False

    def wake_carries_weight_updates(self) -> bool:
        """False: `prepare_for_generation` loads nothing; new weights come only by an update
        (`update_weights`, `update_weights_from_collective`)."""
        return False

    def get_logger_metrics(self) -> dict[str, Any]:
        """The engine's figures (`RolloutEngine.metrics` names: tokens, trajectories, throughput,
        lag, weight updates and their stalls, ...) since `clear_logger_metrics`, or since this
        object was made. Reading does not clear; `engine.metrics()` keeps a window of its own."""
        self._check_open()
        return self._blocking(self.aget_logger_metrics)

    def clear_logger_metrics(self) -> None:
        """Start a new window for `get_logger_metrics`."""
        self._check_open()
        self._blocking(self.aclear_logger_metrics)

    async def aget_logger_metrics(self) -> dict[str, Any]:
        return await self._on_engine(lambda: self._window().read())

    async def aclear_logger_metrics(self) -> None:
        await self._on_engine(lambda: self._window().reset())

    def _window(self) -> MetricsWindow:
        if self._metrics is None:
            self._metrics = self.engine.metrics_window()
        return self._metrics

    def invalidate_kv_cache(self) -> bool:
        """Drop every engine's prefix cache; True when every engine did. Not needed for correctness
        (cache blocks are salted with the weight epoch, so none computed by old weights is reused):
        it frees the memory old epochs' blocks hold."""
        self._check_open()
        return self._blocking(self.ainvalidate_kv_cache)

    async def ainvalidate_kv_cache(self) -> bool:
        async def reset() -> bool:
            results = await fan_out(e.reset_prefix_cache() for e in self.engine.pool.engines)
            return not any(isinstance(r, BaseException) for r in results)

        return await self._on_engine(reset)

    # -- weight refit through vLLM's weight-transfer calls, as NeMo RL's GRPO loop makes them -----

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Every engine joins the trainer's transfer group (vLLM's `init_weight_transfer_engine`,
        `rollout.weights.transfer`): the trainer's `train_world_size` ranks come first (on CPU each runs
        `rollout.weights.trainer.GlooCollective(ip, port, world_size, rank=r, train_world_size=...)`,
        rank 0 hosting the store), the engines' model workers after them. Blocks until the group
        is formed; returns [] (NeMo RL `ray.get`s it with the trainer's futures). Raises
        WeightSyncError when `world_size` is not `train_world_size` + the engines' model workers."""
        self._check_open()
        from rollout.weights.sync_client import WeightSyncClient

        async def transfer() -> WeightTransfer:
            return self.engine.weight_transfer()

        client = WeightSyncClient(self._blocking(transfer), self._blocking)
        client.init_weight_transfer_engine(
            {"master_address": ip, "master_port": port, "rank_offset": train_world_size, "world_size": world_size}
        )
        self._client, self._refit_round = client, 0
        return []

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> None:
        """The trainer's tensors, {HF name: (shape, dtype)} in the order rank 0 broadcasts them,
        checked against the model now (InvalidWeightsError naming each problem) and kept as each
        refit's update info; every update checks them again before any engine changes."""
        from rollout.tensors import TensorSpec, check_specs, read_manifest

        got = {
            n: TensorSpec(str(dtype).removeprefix("torch."), tuple(shape))
            for n, (shape, dtype) in state_dict_info.items()
        }
        check_specs(got, read_manifest(self.engine.model_path), "prepare_refit_info's state_dict_info")
        self._refit = {
            "names": list(got),
            "dtype_names": [s.dtype for s in got.values()],
            "shapes": [list(s.shape) for s in got.values()],
        }

    def update_weights_from_collective(self) -> list[Any]:
        """One refit while the trainer's rank 0 broadcasts: vLLM's start / update / finish calls on
        every engine (`rollout.weights.transfer`); blocks until every engine serves the new epoch or
        left rotation. Returns [a handle `ray.get` gives True from] (NeMo RL checks `all(results)`).
        An engine that failed left rotation and restarts (logged); the call raises WeightSyncError
        when no engine serves the new epoch, InvalidWeightsError when the trainer's tensors do not
        fit the model (no engine changed)."""
        self._check_open()
        if self._client is None:
            raise RuntimeError("update_weights_from_collective before init_collective")
        if self._refit is None:
            raise RuntimeError("update_weights_from_collective before prepare_refit_info")
        before = self.engine.epoch
        self._refit_round += 1
        info = (
            {**self._refit, "round": self._refit_round} if not self.engine.cfg.engines.gpus_per_engine else self._refit
        )
        try:
            self._client.start_weight_update()
            self._client.update_weights(info)
            self._client.finish_weight_update()
        except WeightSyncError as e:
            if self.engine.epoch == before:
                raise
            log.error(
                "weight refit: engines left rotation; the others serve the new epoch",
                epoch=self.engine.epoch,
                failed=e.failed,
            )
        return [self.engine.pool.share(True)]

    def update_weights(self, weights: Any) -> int:
        """`RolloutEngine.update_weights` (a state dict or a directory of HF safetensors): the new epoch.

        Raises what that raises (InvalidWeightsError, WeightSyncError, EngineDeadError).
        """
        self._check_open()
        return self._blocking(self.engine.update_weights, weights)

    def shutdown(self) -> bool:
        """Stop the engines this object started (none when it wraps one); repeated calls are safe."""
        if not self._closed and self._portal is not None:
            try:
                self._engine_cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)
        self._closed = True
        return True

    def _prepare(self, data: Mapping[str, Any], greedy: bool) -> _Call:
        with self._lock:
            prefix = f"gen{self._tag}.{next(self._calls)}-row"
        prompts, width = prompts_from_batch(
            data, self.pad_value, greedy=greedy, sampling=self._sampling, base_stop=self._base_stop, id_prefix=prefix
        )
        return _Call(prompts, width, _dtype(data), self.engine.cfg.sampling, self.engine.limits.max_model_len)

    # -- on the engine's loop -------------------------------------------------------------------

    async def _run(self, prompts: list[Prompt]) -> dict[int, Group]:
        """Submit the call's rows and wait for all of them."""
        if not prompts:
            return {}
        submission = await self._submit(prompts)
        return dict(enumerate(await submission.result()))

    async def _submit(self, prompts: list[Prompt]) -> Submission:
        """The rows, checked now (InvalidPromptError admits none), on a channel of this call's own.

        A call hands out all of its rows before its caller can update weights: it is a step of its
        own size for staleness admission, or rows past max_lag + 1 would wait forever; a row
        dropped as too stale comes back as a failed row."""
        submission = self.engine.submit(prompts)
        self.engine.admit_step(len(prompts))
        return submission

    # -- reaching the engine's loop -------------------------------------------------------------

    def _blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(
                "this call blocks until the engine answers, and this thread runs the engine's event loop: "
                "await agenerate()/generate_async() here, or call it from another thread"
            )
        if self._portal is not None:
            return self._portal.call(fn, *args)
        return anyio.from_thread.run(fn, *args, token=self._token)

    async def _on_engine(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if threading.get_ident() == self._loop_thread:
            return await fn(*args)
        return await anyio.to_thread.run_sync(self._blocking, fn, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RolloutGeneration is shut down")


class _Call:
    """One call's rows: those the engine runs (`submitted`, each with its budget clamped to the
    context left after its prompt) and those with no room at all (`full`), and how to make
    NeMo RL's tensors of them."""

    def __init__(self, prompts: list[Prompt], width: int, dtype: Any, base: Any, max_model_len: int):
        self.prompts, self.width, self.dtype = prompts, width, dtype
        self.full: set[int] = set()
        self.rows: list[int] = []  # submitted prompt k is row rows[k]
        self.submitted: list[Prompt] = []
        for i, p in enumerate(prompts):
            room = max_model_len - len(p.token_ids or ())
            if room <= 0:
                self.full.add(i)
                continue
            s = effective_sampling(base, p)
            if s.max_tokens > room:  # near the context limit: generate what fits, finish reason length
                p = msgspec.structs.replace(
                    p, sampling={**p.sampling, "max_tokens": room, "min_tokens": min(s.min_tokens, room)}
                )
            self.rows.append(i)
            self.submitted.append(p)

    def tensors(self, groups: dict[int, Group], pad_value: int, rows: list[int] | None = None) -> dict[str, Any]:
        """NeMo RL's output for `rows` (default all), from the submitted prompts' `groups` (by
        submission index). Raises GenerationError naming every failed row."""
        by_row = {self.rows[k]: g for k, g in groups.items()}
        for i in self.full:  # the prompt alone fills the context: returned as is
            p = self.prompts[i]
            by_row[i] = Group(
                p.id, p, [Trajectory(prompt_id=p.id, prompt_token_ids=list(p.token_ids or ()), finish_reason="length")]
            )
        wanted = sorted(by_row) if rows is None else rows
        return output_tensors(_successes({i: by_row[i] for i in wanted}), self.width, pad_value, self.dtype)


def _dtype(data: Mapping[str, Any]) -> Any:
    import torch

    ids = data["input_ids"]
    return ids.dtype if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else torch.long


def _successes(groups: dict[int, Group]) -> list[Trajectory]:
    """Each row's trajectory in row order. Raises GenerationError naming every row that failed."""
    failed, out = {}, []
    for i in sorted(groups):
        group = groups[i]
        t = group.trajectories[0] if group.trajectories else None
        if group.error is not None or t is None:
            failed[i] = group.error or "no sample came back"
        elif t.finish_reason in ("error", "abort"):
            failed[i] = t.error or f"finish reason {t.finish_reason!r}"
        else:
            out.append(t)
    if failed:
        detail = "; ".join(f"row {i}: {reason}" for i, reason in failed.items())
        raise GenerationError(f"{len(failed)} of {len(groups)} rows failed: {detail}", failed)
    return out
