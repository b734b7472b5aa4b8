"""`rollout bench` with `env` set: multi-turn episodes through this engine against a careful
agent loop on raw vLLM, on the same engines, in one run.

Both sides play the same episodes (same prompts, the same environment, token-id observations,
each turn `sampling.max_tokens` generated): this engine (the scheduler: each episode's turns on one
engine, reusing the KV of the turns before); and an agent loop straight into each engine's vLLM
written as a careful user would: episode e always on engine e mod E, so vLLM's own
prefix cache keeps its history, and each engine's turns sent in one call (every episode on that
engine that is still playing has its next turn ready, then they go together, as `LLM.generate`
of a batch would). A call per turn into a busy CPU engine actor costs about a second here, so a
loop making one per turn measures its own round trips, not vLLM. Every episode runs concurrently
on each side; prefix caches are reset before each side; rounds alternate the order. Reports
generated tokens/s of each side and the median over rounds of this engine / raw vLLM.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.episodes.chat import chat_renderer
from rollout.episodes.env import load_env
from rollout.episodes.loop import run_episode
from rollout.inputs.prompts import configured_prompts, effective_sampling
from rollout.scheduling.protocols import Engine
from rollout.types import Prompt, Request, Trajectory


async def run(engine: RolloutEngine, cfg: Config, rounds: int) -> dict[str, Any]:
    prompts = [
        p if p.id else msgspec.structs.replace(p, id=f"ep{i}")
        for i, p in enumerate(configured_prompts(cfg.prompts, engine.limits.vocab_size))
    ]
    sides = {"engine": lambda: _ours(engine, prompts), "raw": lambda: _raw(engine, cfg, prompts)}
    await sides["raw"]()  # warm-up: every batch shape of the turns compiled once
    table = []
    for r in range(rounds):
        row: dict[str, Any] = {}
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            for e in engine.pool.engines:  # type: ignore[union-attr]
                await e.reset_prefix_cache()
            row[name] = await sides[name]()
        table.append(row)
    ratio = statistics.median(row["engine"]["tokens_per_s"] / row["raw"]["tokens_per_s"] for row in table)
    return {"rounds": table, "ratio_vs_raw": ratio, "episodes": len(prompts), "turns": cfg.episode.max_turns}


async def _ours(engine: RolloutEngine, prompts: list[Prompt]) -> dict[str, Any]:
    start = time.perf_counter()
    submission = engine.submit(prompts, train=False)
    groups = await submission.result()
    return _figures([t for g in groups for t in g.trajectories], time.perf_counter() - start)


class _Turns:
    """One engine's turns on the raw side: held until every episode still playing there has its
    next turn ready, then sent in one call."""

    def __init__(self, engine: Engine, playing: int, tg: TaskGroup):
        self.engine, self.playing, self.tg = engine, playing, tg
        self.pending: list[tuple[Request, anyio.Event, list[Any]]] = []

    async def turn(self, req: Request) -> tuple[list[int], list[float], str]:
        done, out = anyio.Event(), []
        self.pending.append((msgspec.structs.replace(req, cache_salt=None), done, out))
        self._flush()
        await done.wait()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def ended(self) -> None:
        self.playing -= 1
        self._flush()

    def _flush(self) -> None:
        if self.pending and len(self.pending) == self.playing:
            batch, self.pending = self.pending, []
            self.tg.start_soon(self._send, batch)

    async def _send(self, batch: list[tuple[Request, anyio.Event, list[Any]]]) -> None:
        try:
            outputs: list[Any] = (await self.engine.run_raw([r for r, _, _ in batch], outputs=True))["outputs"]
        except Exception as e:  # every turn of the call fails with it (each episode says why)
            outputs = [e] * len(batch)
        for (_, done, out), result in zip(batch, outputs):
            out.append(result)
            done.set()


async def _raw(engine: RolloutEngine, cfg: Config, prompts: list[Prompt]) -> dict[str, Any]:
    engines = engine.pool.engines  # type: ignore[union-attr]
    env = load_env(cfg.env, cfg.env_args)  # as the engine loads them
    chat = await anyio.to_thread.run_sync(
        chat_renderer, engine.model_path, cfg.serve.tool_parser, cfg.serve.reasoning_parser
    )
    assert env is not None
    episodes: list[Trajectory] = []

    async def one(e: int, prompt: Prompt, turns: _Turns) -> None:
        async def run_turn(req: Request) -> Trajectory:
            ids, lps, reason = await turns.turn(req)
            return Trajectory(request_id=req.request_id, prompt_token_ids=list(req.token_ids or []),
                              token_ids=list(ids), logprobs=list(lps),
                              finish_reason=reason if reason in ("stop", "length") else "stop",
                              policy_epochs=[(0, 0)] if ids else [], engine_id=e % len(engines))  # fmt: skip

        sampling = effective_sampling(cfg.sampling, prompt)
        request = Request(
            f"raw{e}",
            prompt.id,
            0,
            msgspec.structs.replace(sampling, n=1),
            token_ids=prompt.token_ids,
            text=prompt.text,
        )
        try:
            episodes.append(await run_episode(request, prompt, env(), cfg.episode, engine.limits, chat, run_turn))
        finally:
            turns.ended()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        calls = [_Turns(x, len(range(i, len(prompts), len(engines))), tg) for i, x in enumerate(engines)]
        for e, p in enumerate(prompts):
            tg.start_soon(one, e, p, calls[e % len(engines)])
    return _figures(episodes, time.perf_counter() - start)


def _figures(episodes: list[Trajectory], elapsed: float) -> dict[str, Any]:
    ok = [t for t in episodes if t.ok]
    tokens = sum(len(turn.token_ids) for t in ok for turn in t.turns)
    later = [turn for t in ok for turn in t.turns[1:]]  # turns that could reuse the KV of the turns before
    return {"elapsed_s": elapsed, "episodes": len(episodes), "failed": len(episodes) - len(ok),
            "generated_tokens": tokens, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "kv_reused_fraction": sum(turn.kv_reused for turn in later)
                                  / max(1, sum(len(turn.prompt_token_ids) for turn in later))}  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    rows = report["rounds"]
    lines = [
        f"multi-turn: {report['episodes']} episodes x up to {report['turns']} turns | generated tokens/s",
        "raw vLLM: each episode on one engine (prefix caching), each engine's turns in one call",
        f"{'round':<7}{'this engine':>14}{'raw vLLM':>14}{'ratio':>10}",
    ]
    for k, row in enumerate(rows, 1):
        ours, raw = row["engine"]["tokens_per_s"], row["raw"]["tokens_per_s"]
        lines.append(f"{k:<7}{ours:>14.1f}{raw:>14.1f}{ours / raw:>10.3f}")
    lines.append(f"median ratio over {len(rows)} rounds: this engine / raw vLLM {report['ratio_vs_raw']:.3f}")
    reused = statistics.mean(row["engine"]["kv_reused_fraction"] for row in rows)
    lines.append(f"this engine: {reused:.1%} of later turns' prompt tokens reused the KV of the turns before")
    failed = sum(row[s]["failed"] for row in rows for s in row)
    if failed:
        lines.append(f"failed episodes: {failed}")
    return "\n".join(lines)
