"""NeMo RL's generation interface over `RolloutEngine`, so a NeMo-RL-style trainer can swap it in.

Owns: turning a right-padded batch (`input_ids` [B, S], `input_lengths` [B], optional per-row
`stop_strings`) into one `n=1` prompt per row, routing each finished group back to its row, and
building NeMo RL's output tensors. Row i of the output is row i of the input, always. Does not
own: scheduling, sampling, weights (all `RolloutEngine`'s).

    gen = RolloutGeneration("configs/tiny.yaml")          # starts and owns the engines
    out = gen.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)
    gen.shutdown()

Reaching the engine: a `RolloutEngine` lives on one event loop. Built from a config, this class
starts it on a loop in a thread of its own (as `SyncRolloutEngine` does); given a running engine
(`engine=`), it uses that engine's loop and must be created on it. Blocking methods hop onto that
loop; `agenerate` and `generate_async` run on it directly when awaited there, and otherwise step
through a worker thread, so they work from any loop. Calls may overlap: the engine has one output
queue, so whichever call is waiting reads the next group and hands it to the call that fed it
(prompt ids `gen<facade>.<call>-row<i>`). While a call runs, this class must be the engine's only consumer.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.errors import InvalidPromptError, RolloutError
from rollout.prompts import effective_sampling
from rollout.types import Group, Prompt, Trajectory

T = TypeVar("T")
_instances = itertools.count()  # prompt ids differ between facades sharing an engine one after another
GREEDY = {"temperature": 0.0, "top_k": 1}
PAIRS = (("input_ids", "input_lengths"), ("output_ids", "unpadded_sequence_lengths"))


class GenerationError(RolloutError):
    """Rows whose sample failed in the engine (finish reason error or abort); `rows`: row -> reason."""

    def __init__(self, message: str, rows: dict[int, str]):
        super().__init__(message)
        self.rows = rows


def verify_right_padding(
    data: Mapping[str, Any], pad_value: int | None = 0, raise_error: bool = True
) -> tuple[bool, str | None]:
    """Check that every position past a row's length holds `pad_value`.

    Checks `input_ids` against `input_lengths` when both are present, else `output_ids` against
    `unpadded_sequence_lengths`. Returns `(True, None)` or `(False, message)`; with `raise_error`
    (the default) raises ValueError with that message instead.
    """
    import torch

    def fail(message: str) -> tuple[bool, str | None]:
        if raise_error:
            raise ValueError(message)
        return False, message

    if pad_value is None:
        return fail("pad_value is None: pass the tokenizer's pad token id")
    if not isinstance(data, Mapping):
        return fail(f"expected a mapping of tensors (a dict or BatchedDataDict), got {type(data).__name__}")
    pair = next((p for p in PAIRS if p[0] in data and p[1] in data), None)
    if pair is None:
        pairs = "input_ids with input_lengths, or output_ids with unpadded_sequence_lengths"
        return fail(f"expected {pairs}; got keys {list(data.keys())}")
    ids_key, len_key = pair
    ids, lengths = torch.as_tensor(data[ids_key]), torch.as_tensor(data[len_key])
    if ids.ndim != 2:
        return fail(f"{ids_key}: expected a 2-D [batch, sequence] tensor, got shape {tuple(ids.shape)}")
    batch, width = ids.shape
    if lengths.ndim != 1 or lengths.shape[0] != batch:
        shape = tuple(lengths.shape)
        return fail(f"{len_key}: expected one length per row of {ids_key}, shape ({batch},), got shape {shape}")
    if lengths.is_floating_point() or lengths.is_complex():
        return fail(f"{len_key}: expected integer lengths, got {lengths.dtype}")
    lengths = lengths.to(device=ids.device, dtype=torch.long)
    if (lengths < 0).any():
        i = int((lengths < 0).nonzero()[0])
        return fail(f"{len_key}[{i}] = {int(lengths[i])} is negative")
    if (lengths > width).any():
        i = int((lengths > width).nonzero()[0])
        return fail(f"{len_key}[{i}] = {int(lengths[i])} exceeds the sequence dimension of {ids_key} ({width})")
    bad = (torch.arange(width, device=ids.device)[None, :] >= lengths[:, None]) & (ids != pad_value)
    if bad.any():
        i = int(bad.any(dim=1).nonzero()[0])
        positions = bad[i].nonzero().flatten().tolist()
        shown = ", ".join(map(str, positions[:8])) + (", ..." if len(positions) > 8 else "")
        return fail(
            f"{ids_key} is not right-padded with pad value {pad_value}: row {i} has length {int(lengths[i])} "
            f"but holds other values at positions [{shown}]"
        )
    return True, None


def prompts_from_batch(
    data: Mapping[str, Any],
    pad_value: int,
    *,
    greedy: bool = False,
    sampling: Mapping[str, Any] | None = None,
    base_stop: Sequence[str] = (),
    id_prefix: str = "row",
) -> tuple[list[Prompt], int]:
    """One `n=1` Prompt per row (`token_ids = input_ids[i, :input_lengths[i]]`), and the input width S.

    `sampling` overrides apply to every row; `greedy` adds temperature 0 / top_k 1. A row's
    `stop_strings` (a list, a string, or None) are added to `base_stop` (the configured ones) for
    that row only. Prompt ids are `{id_prefix}{i}`. Raises InvalidPromptError naming the problem:
    missing keys, a batch that is not right-padded (verify_right_padding's message), an empty
    row, non-integer ids, `stop_strings` not one per row.
    """
    import torch

    if not isinstance(data, Mapping) or "input_ids" not in data or "input_lengths" not in data:
        got = f"keys {list(data.keys())}" if isinstance(data, Mapping) else f"a {type(data).__name__}"
        raise InvalidPromptError(f"data: generation needs a mapping with input_ids and input_lengths, got {got}")
    checked = {"input_ids": data["input_ids"], "input_lengths": data["input_lengths"]}
    ok, message = verify_right_padding(checked, pad_value, raise_error=False)
    if not ok:
        raise InvalidPromptError(message)
    ids, lengths = torch.as_tensor(data["input_ids"]), torch.as_tensor(data["input_lengths"]).tolist()
    if ids.is_floating_point() or ids.is_complex():
        raise InvalidPromptError(f"input_ids: expected integer token ids, got {ids.dtype}")
    if 0 in lengths:
        raise InvalidPromptError(f"input_lengths[{lengths.index(0)}] is 0: every row needs at least one prompt token")
    base = {**(sampling or {}), "n": 1, **(GREEDY if greedy else {})}
    prompts = []
    for i, (length, stop) in enumerate(zip(lengths, _row_stops(data.get("stop_strings"), len(lengths)))):
        overrides = {**base, "stop": list(dict.fromkeys([*base_stop, *stop]))} if stop else base
        prompts.append(Prompt(token_ids=ids[i, :length].tolist(), id=f"{id_prefix}{i}", sampling=overrides))
    return prompts, ids.shape[1]


def _row_stops(stop_strings: Any, batch: int) -> list[list[str]]:
    if stop_strings is None:
        return [[] for _ in range(batch)]
    if isinstance(stop_strings, str) or len(stop_strings) != batch:
        got = "a string" if isinstance(stop_strings, str) else f"{len(stop_strings)} entries"
        raise InvalidPromptError(f"stop_strings: expected one entry per row ({batch}), got {got}")
    out = [[] if s is None else [s] if isinstance(s, str) else list(s) for s in stop_strings]
    for i, s in enumerate(out):
        if not all(isinstance(x, str) and x for x in s):
            raise InvalidPromptError(f"stop_strings[{i}]: expected None, a string or non-empty strings, got {s!r}")
    return out


def output_tensors(trajectories: Sequence[Trajectory], input_width: int, pad_value: int) -> dict[str, Any]:
    """NeMo RL's generation output, one row per trajectory, right-padded with `pad_value`.

    Width: `input_width` plus the longest generation (as NeMo RL's vLLM backend sizes it).
    `output_ids`: prompt then generated tokens. `logprobs`: the sampled token's logprob at each
    generated position, 0.0 on prompt and padding. `token_epochs`: the policy epoch of each
    generated token, -1 elsewhere. `truncated`: finish reason "length". All on the CPU.
    """
    import torch

    gen = [len(t.token_ids) for t in trajectories]
    b, width = len(trajectories), input_width + max(gen, default=0)
    output_ids = torch.full((b, width), pad_value, dtype=torch.long)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    epochs = torch.full((b, width), -1, dtype=torch.long)
    for r, t in enumerate(trajectories):
        p, g = len(t.prompt_token_ids), len(t.token_ids)
        output_ids[r, : p + g] = torch.tensor(t.prompt_token_ids + t.token_ids, dtype=torch.long)
        logprobs[r, p : p + g] = torch.tensor(t.logprobs, dtype=torch.float32)
        epochs[r, p : p + g] = torch.tensor(t.token_epochs(), dtype=torch.long)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": torch.tensor(gen, dtype=torch.long),
        "unpadded_sequence_lengths": torch.tensor([len(t.prompt_token_ids) + len(t.token_ids) for t in trajectories]),
        "truncated": torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool),
        "token_epochs": epochs,
    }


def pad_id_from_model_dir(path: str | Path) -> int | None:
    """The model's pad token id: the tokenizer's pad token, else config.json's `pad_token_id`; None if neither."""
    path = Path(path)
    if (path / "tokenizer_config.json").is_file() and (path / "tokenizer.json").is_file():
        pad = json.loads((path / "tokenizer_config.json").read_text()).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        if pad:
            from tokenizers import Tokenizer

            if (pad_id := Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(pad)) is not None:
                return pad_id
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None


class _Call:
    """One call's rows in flight; groups routed to it wait in `arrived` as (row, group)."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts = prompts
        self.arrived: deque[tuple[int, Group]] = deque()


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
        self._lock = threading.Lock()  # guards _routes and the call counter: callers' threads use them
        self._routes: dict[str, tuple[_Call, int]] = {}  # prompt id of a row in flight -> (call, row)
        self._calls = itertools.count()
        self._tag = next(_instances)
        self._reading = False  # a call is awaiting the engine's next group
        self._changed: anyio.Event | None = None  # set when a read ends; created on the engine loop
        owned = engine is None
        self.engine = engine = RolloutEngine(cfg, **engine_kwargs) if owned else engine  # type: ignore[arg-type]
        if not owned:
            engine.limits  # noqa: B018 -- raises RuntimeError unless the engine is running
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
        `pad_value`), `logprobs` (aligned with `output_ids`), `generation_lengths`,
        `unpadded_sequence_lengths`, `truncated`, `token_epochs` (see `output_tensors`).
        Raises InvalidPromptError on bad input, nothing admitted (a batch that is not
        right-padded: verify_right_padding's message); GenerationError naming every failed row,
        once all rows are done; EngineDeadError. Not on the engine's loop (there: `agenerate`).
        """
        self._check_open()
        call, width = self._prepare(data, greedy)
        return output_tensors(_successes(self._blocking(self._run, call)), width, self.pad_value)

    async def agenerate(self, data: Mapping[str, Any], greedy: bool = False) -> dict[str, Any]:
        """`generate`, awaitable from any event loop."""
        self._check_open()
        call, width = self._prepare(data, greedy)
        return output_tensors(_successes(await self._on_engine(self._run, call)), width, self.pad_value)

    async def generate_async(
        self, data: Mapping[str, Any], greedy: bool = False
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield `(row index, one-row result)` as each row finishes, every row exactly once.

        A one-row result has `generate`'s keys, width S + its generation. A failed row raises
        GenerationError when it comes up (rows yielded before it stand). Leaving early is fine:
        rows still running are dropped as they finish.
        """
        self._check_open()
        call, width = self._prepare(data, greedy)
        if call.prompts:
            await self._on_engine(self._submit, call)
        for _ in call.prompts:
            i, group = await self._on_engine(self._next_row, call)
            yield i, output_tensors(_successes({i: group}), width, self.pad_value)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Ready the engines for a generation phase: a no-op, returns True.

        NeMo RL wakes sleeping vLLM engines here (`AsyncLLM.wake_up`). These never sleep: vLLM's
        sleep mode needs CUDA, ROCm or XPU (not CPU), and the engine interface
        (`rollout.backend.Engine`) has no sleep/wake, so the engines stay loaded between phases.
        """
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """End a generation phase: a no-op, returns True (see `prepare_for_generation`).

        NeMo RL also resets the prefix cache here; not needed: cache blocks are salted with the
        weight epoch, so none computed by old weights is reused after `update_weights`.
        """
        return True

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

    def _prepare(self, data: Mapping[str, Any], greedy: bool) -> tuple[_Call, int]:
        with self._lock:
            prefix = f"gen{self._tag}.{next(self._calls)}-row"
        prompts, width = prompts_from_batch(
            data, self.pad_value, greedy=greedy, sampling=self._sampling, base_stop=self._base_stop, id_prefix=prefix
        )
        return _Call(prompts), width

    # -- on the engine's loop -------------------------------------------------------------------

    async def _run(self, call: _Call) -> dict[int, Group]:
        """Feed the call's rows and wait for all of them."""
        groups: dict[int, Group] = {}
        if call.prompts:
            await self._submit(call)
        while len(groups) < len(call.prompts):
            i, group = await self._next_row(call)
            groups[i] = group
        return groups

    async def _submit(self, call: _Call) -> None:
        """Register the rows, then feed them (checked now: InvalidPromptError admits none)."""
        if self._changed is None:
            self._changed = anyio.Event()
        with self._lock:
            self._routes.update({p.id: (call, i) for i, p in enumerate(call.prompts)})
        try:
            self.engine.feed(call.prompts)
        except BaseException:
            with self._lock:
                for p in call.prompts:
                    del self._routes[p.id]
            raise

    async def _next_row(self, call: _Call) -> tuple[int, Group]:
        """The next finished row of `call`. One waiting call at a time reads the engine's queue and
        hands the group to the call that fed it; the others wait for that, then look again."""
        while not call.arrived:
            if self._reading:
                await self._changed.wait()  # type: ignore[union-attr]
                continue
            self._reading = True
            try:
                group = await self.engine.next_group()
            finally:
                self._reading = False
                self._changed.set()  # type: ignore[union-attr]
                self._changed = anyio.Event()
            if group is None:
                raise RuntimeError("the engine handed out every fed prompt while rows were still pending")
            with self._lock:
                owner = self._routes.pop(group.prompt_id, None)
            if owner is None:
                raise RuntimeError(
                    f"the engine handed out group {group.prompt_id!r}, which this RolloutGeneration did not feed: "
                    "while a call runs it must be the engine's only consumer"
                )
            owner[0].arrived.append((owner[1], group))  # a call nobody waits for any more keeps it, unread
        return call.arrived.popleft()

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
