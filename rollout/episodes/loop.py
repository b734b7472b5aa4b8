"""Multi-turn episodes: an environment and the model taking turns, one training sample at the end.

Owns one episode's loop (the scheduler runs one per sample of a prompt when `env` is set):
  1) reset the environment; the first prompt is the prompt's tokens, or its text rendered with the
     chat template, plus what `reset` observed;
  2) run a model turn on the episode's engine (`run_turn`: the scheduler keeps the episode on one
     engine, moves it if that engine dies, and passes the episode's cache salt so the turn reuses
     the KV of the turns before);
  3) hand the turn to `env.step`; its observation becomes tokens appended to the conversation
     (`rollout.episodes.chat`: never re-tokenized, so turn k+1's prompt is exactly turn k's prompt + its
     tokens + the observation's), until the environment says done or a limit is reached
     (`episode.max_turns`, `episode.max_tokens` of context, `model.max_model_len`);
  4) fold the turns into one `Trajectory` (`assemble`): `token_ids` after the first prompt, model
     tokens with `loss_mask` 1 and their logprobs and epochs, observation tokens with 0 / 0.0 / -1;
     `turns` keeps every turn's own records; `reward` is the sum of the step rewards.
An environment that raises, times out or answers garbage (every field of its `Step` is checked,
`rollout.episodes.env`) fails this episode only (`EnvError`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollout.config import EpisodeConfig
from rollout.episodes.chat import ChatRenderer
from rollout.episodes.env import Action, EnvError, as_messages, as_step, call, check_ids
from rollout.epochs import append_run, kv_runs
from rollout.inputs.prompts import ModelLimits
from rollout.types import Prompt, Request, Sampling, Trajectory

TurnRunner = Callable[[Request], Awaitable[Trajectory]]


async def run_episode(
    request: Request,
    prompt: Prompt,
    env: Any,
    cfg: EpisodeConfig,
    limits: ModelLimits,
    renderer: ChatRenderer | None,
    run_turn: TurnRunner,
) -> Trajectory:
    """Play one episode of `request` (one sample of `prompt`) against `env`; never raises but
    cancellation: a failure is the returned trajectory's `error`."""
    turns: list[Trajectory] = []
    observations: list[list[int]] = []
    rewards: list[float] = []
    finish, error = "length", None
    try:
        context = await _first_prompt(prompt, env, cfg, limits, renderer)
        salt = f"ep:{request.request_id}"
        limit = min(cfg.max_tokens or limits.max_model_len, limits.max_model_len)
        for k in range(cfg.max_turns):
            budget = min(request.sampling.max_tokens, limit - len(context))
            if budget < 1:
                break
            turn = await run_turn(Request(
                f"{request.request_id}.t{k}", request.prompt_id, request.sample_index,
                _turn_sampling(request.sampling, budget), token_ids=context, cache_salt=salt,
            ))  # fmt: skip
            if turns and turn.ok:  # the positions it reused hold the KV the turn before left
                turn.kv_epochs = kv_runs(len(turn.prompt_token_ids), len(turn.token_ids), turn.policy_epochs,
                                         turn.kv_recomputes, turn.kv_reused, turns[-1].kv_epochs)  # fmt: skip
            turns.append(turn)
            if not turn.ok or turn.finish_reason == "abort":
                finish, error = turn.finish_reason, turn.error
                break
            action = _action(turn, renderer, k)
            what = f"step of turn {k}"
            step = as_step(await call(env.step, action, cfg.step_timeout_s, what), what)
            turn.reward = step.reward
            rewards.append(step.reward)
            if step.done:
                finish = "stop"
                break
            obs = _observation_ids(step.observation, turn, renderer, limits, k)
            salt = turn.cache_salt
            context = context + turn.token_ids + obs
            if len(context) >= limit:
                break  # the observation leaves no room for another turn
            observations.append(obs)
    except EnvError as e:
        finish, error = "error", f"episode {request.request_id}: {e}"
    episode = assemble(request, turns, observations, finish, error)
    if episode.ok and rewards:
        episode.reward = sum(rewards)
    return episode


async def _first_prompt(
    prompt: Prompt, env: Any, cfg: EpisodeConfig, limits: ModelLimits, renderer: ChatRenderer | None
) -> list[int]:
    obs = as_messages(await call(env.reset, prompt, cfg.step_timeout_s, "reset"), "environment reset: observation")
    if prompt.token_ids is not None:
        ids = list(prompt.token_ids)
        if isinstance(obs, list) and obs and isinstance(obs[0], int):
            ids += obs
        elif obs:
            ids += _render(_need(renderer, "a text observation").render, obs, "the first prompt")
    else:
        said = obs if obs and isinstance(obs[0], dict) else []
        system = [m for m in said if m["role"] == "system"]  # an environment's instructions come first
        messages = [
            *system,
            {"role": "user", "content": prompt.text or ""},
            *[m for m in said if m["role"] != "system"],
        ]
        ids = _render(_need(renderer, "a text prompt in an episode").render, messages, "the first prompt")
        if obs and isinstance(obs[0], int):
            ids += obs
    check_ids(ids, limits.vocab_size, "the first prompt")
    if len(ids) >= limits.max_model_len:
        raise EnvError(f"the first prompt has {len(ids)} tokens, model.max_model_len is {limits.max_model_len}")
    return ids


def _observation_ids(
    observation: Any, turn: Trajectory, renderer: ChatRenderer | None, limits: ModelLimits, k: int
) -> list[int]:
    """The tokens an observation appends after turn `k`: token ids as they are; messages rendered
    by the chat template after the turn's end-of-turn token (added first when the model did not
    end its turn itself)."""
    messages = as_messages(observation)
    if not messages:
        raise EnvError(f"environment step of turn {k} returned no observation and did not end the episode")
    if isinstance(messages[0], int):
        ids = list(messages)
    else:
        chat = _need(renderer, "a text observation")
        ended = turn.token_ids[-1:] == [chat.end_of_turn]
        ids = ([] if ended else [chat.end_of_turn]) + _render(chat.append, messages, f"observation of turn {k}")
    check_ids(ids, limits.vocab_size, f"observation of turn {k}")
    return ids


def _action(turn: Trajectory, renderer: ChatRenderer | None, k: int) -> Action:
    """The turn as the environment sees it: its text, and what vLLM's parsers read in it."""
    text = renderer.decode(turn.token_ids) if renderer else ""
    if renderer is None or renderer.parsers is None:
        return Action(text, list(turn.token_ids), turn.finish_reason, k, content=text)
    p = renderer.parsers
    parsed = p.parse(p.any_tools(), text, list(turn.token_ids), list(turn.prompt_token_ids))
    return Action(
        text, list(turn.token_ids), turn.finish_reason, k, parsed["content"], parsed["tool_calls"], parsed["reasoning"]
    )


def _render(
    render: Callable[[list[dict[str, Any]]], list[int]], messages: list[dict[str, Any]], what: str
) -> list[int]:
    """Messages an environment sent, through the chat template: what it cannot render (a value
    the template chokes on, a template that is not a suffix) fails the episode, naming `what`."""
    try:
        return render(messages)
    except Exception as e:
        raise EnvError(f"{what}: the chat template cannot render it: {type(e).__name__}: {e}") from e


def _need(renderer: ChatRenderer | None, what: str) -> ChatRenderer:
    if renderer is None:
        raise EnvError(f"{what} needs a chat template, and the model has none: use token ids")
    return renderer


def _turn_sampling(sampling: Sampling, budget: int) -> Sampling:
    import msgspec

    if budget >= sampling.max_tokens:
        return sampling
    return msgspec.structs.replace(sampling, max_tokens=budget, min_tokens=min(sampling.min_tokens, budget))


def assemble(
    request: Request, turns: list[Trajectory], observations: list[list[int]], finish: str, error: str | None
) -> Trajectory:
    """One trajectory for the whole episode (module docstring, step 4)."""
    first = turns[0].prompt_token_ids if turns else list(request.token_ids or [])
    ep = Trajectory(
        request_id=request.request_id, prompt_id=request.prompt_id, sample_index=request.sample_index,
        prompt_token_ids=list(first), finish_reason=finish, error=error, turns=turns,  # type: ignore[arg-type]
        engine_id=turns[-1].engine_id if turns else -1, submitted_at=turns[0].submitted_at if turns else time.time(),
        first_token_at=turns[0].first_token_at if turns else 0.0, finished_at=time.time(),
    )  # fmt: skip
    for k, turn in enumerate(turns):
        offset = len(ep.token_ids)
        for start, epoch in turn.policy_epochs:
            append_run(ep.policy_epochs, offset + start, epoch)
        ep.token_ids += turn.token_ids
        ep.logprobs += turn.logprobs
        ep.loss_mask += [1] * len(turn.token_ids)
        if k + 1 < len(turns):  # an observation the next turn saw (one past the last turn is dropped)
            append_run(ep.policy_epochs, len(ep.token_ids), -1)
            ep.token_ids += observations[k]
            ep.logprobs += [0.0] * len(observations[k])
            ep.loss_mask += [0] * len(observations[k])
        ep.num_preemptions += turn.num_preemptions
    if turns:
        ep.kv_epochs = list(turns[-1].kv_epochs)
    return ep
