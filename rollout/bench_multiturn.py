"""`rollout bench` with `env` set: multi-turn episodes through this engine against naive agent
loops on raw vLLM, on the same engines, in one run.

Three sides play the same episodes (same prompts, the same environment, token-id observations,
each turn `sampling.max_tokens` generated): this engine (the scheduler: each episode's turns on one
engine, reusing the KV of the turns before); a naive agent loop straight into each engine's vLLM,
each turn a fresh request carrying the whole history, dealt round-robin over the engines (turn k
of episode e on engine (e + k) mod E: what a client calling a pool of vLLM servers does); and the
same loop with perfect engine affinity (episode e always on engine e mod E, vLLM's own prefix
cache reusing the history). Every episode runs concurrently on each side; prefix caches are reset
before each side; rounds alternate the order. Reports generated tokens/s of each side and the
medians over rounds of this engine / naive and this engine / affinity.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio
import msgspec

from rollout.config import Config
from rollout.engine import RolloutEngine
from rollout.episodes import run_episode
from rollout.prompts import configured_prompts, effective_sampling
from rollout.types import Prompt, Request, Trajectory


async def run(engine: RolloutEngine, cfg: Config, rounds: int) -> dict[str, Any]:
    prompts = [p if p.id else msgspec.structs.replace(p, id=f"ep{i}") for i, p in enumerate(configured_prompts(cfg.prompts, engine.limits.vocab_size))]
    sides = {"engine": lambda: _ours(engine, prompts), "naive": lambda: _raw(engine, cfg, prompts, affinity=False),
             "affinity": lambda: _raw(engine, cfg, prompts, affinity=True)}  # fmt: skip
    await sides["naive"]()  # warm-up: every batch shape of the turns compiled once
    table = []
    for r in range(rounds):
        row: dict[str, Any] = {}
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            for e in engine.pool.engines:  # type: ignore[union-attr]
                await e.reset_prefix_cache()
            row[name] = await sides[name]()
        table.append(row)
    ratio = {k: statistics.median(row["engine"]["tokens_per_s"] / row[k]["tokens_per_s"] for row in table) for k in ("naive", "affinity")}
    return {"rounds": table, "ratio_vs_naive": ratio["naive"], "ratio_vs_affinity": ratio["affinity"],
            "episodes": len(prompts), "turns": cfg.episode.max_turns}  # fmt: skip


async def _ours(engine: RolloutEngine, prompts: list[Prompt]) -> dict[str, Any]:
    start = time.perf_counter()
    submission = engine.submit(prompts, train=False)
    groups = await submission.result()
    return _figures([t for g in groups for t in g.trajectories], time.perf_counter() - start)


async def _raw(engine: RolloutEngine, cfg: Config, prompts: list[Prompt], affinity: bool) -> dict[str, Any]:
    engines = engine.pool.engines  # type: ignore[union-attr]
    scheduler = engine._live_scheduler()
    assert scheduler.env is not None
    episodes: list[Trajectory] = []

    async def one(e: int, prompt: Prompt) -> None:
        turn = 0

        async def run_turn(req: Request) -> Trajectory:
            nonlocal turn
            i = (e if affinity else e + turn) % len(engines)
            turn += 1
            raw = msgspec.structs.replace(req, cache_salt=None)
            (ids, lps, reason), = (await engines[i].run_raw([raw], outputs=True))["outputs"]
            return Trajectory(request_id=req.request_id, prompt_token_ids=list(req.token_ids or []), token_ids=list(ids),
                              logprobs=list(lps), finish_reason=reason if reason in ("stop", "length") else "stop",
                              policy_epochs=[(0, 0)] if ids else [], engine_id=i)  # fmt: skip

        sampling = effective_sampling(cfg.sampling, prompt)
        request = Request(f"raw{e}", prompt.id, 0, msgspec.structs.replace(sampling, n=1), token_ids=prompt.token_ids, text=prompt.text)
        episodes.append(await run_episode(request, prompt, scheduler.env(), cfg.episode, scheduler.limits, scheduler.chat, run_turn))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for e, p in enumerate(prompts):
            tg.start_soon(one, e, p)
    return _figures(episodes, time.perf_counter() - start)


def _figures(episodes: list[Trajectory], elapsed: float) -> dict[str, Any]:
    ok = [t for t in episodes if t.ok]
    tokens = sum(len(turn.token_ids) for t in ok for turn in t.turns)
    later = [turn for t in ok for turn in t.turns[1:]]  # turns that could reuse the KV of the turns before
    return {"elapsed_s": elapsed, "episodes": len(episodes), "failed": len(episodes) - len(ok), "generated_tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "kv_reused_fraction": sum(turn.kv_reused for turn in later) / max(1, sum(len(turn.prompt_token_ids) for turn in later))}  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    rows = report["rounds"]
    lines = [
        f"multi-turn: {report['episodes']} episodes x up to {report['turns']} turns | generated tokens/s",
        f"{'round':<7}{'this engine':>14}{'naive loop':>14}{'affinity':>14}{'vs naive':>10}{'vs affinity':>13}",
    ]
    for k, row in enumerate(rows, 1):
        ours, naive, aff = (row[s]["tokens_per_s"] for s in ("engine", "naive", "affinity"))
        lines.append(f"{k:<7}{ours:>14.1f}{naive:>14.1f}{aff:>14.1f}{ours / naive:>10.3f}{ours / aff:>13.3f}")
    lines.append(f"median ratio over {len(rows)} rounds: this engine / naive loop {report['ratio_vs_naive']:.3f}, "
                 f"this engine / raw vLLM with affinity {report['ratio_vs_affinity']:.3f}")  # fmt: skip
    reused = statistics.mean(row["engine"]["kv_reused_fraction"] for row in rows)
    lines.append(f"this engine: {reused:.1%} of later turns' prompt tokens reused the KV of the turns before")
    failed = sum(row[s]["failed"] for row in rows for s in row)
    if failed:
        lines.append(f"failed episodes: {failed}")
    return "\n".join(lines)
