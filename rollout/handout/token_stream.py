"""A streamed prompt's tokens as its engine generates them: `TokenStream`, one per prompt of a
caller's streamed submission (`RolloutEngine.submit(..., on_tokens=...)`).

The engine sends a streamed sample's new tokens after every step (`rollout.types.Delta`), only
those its finished trajectory keeps, with the sample's exact epoch records so far. The stream
keeps each sample's tokens so far and hands the new ones to the caller's `on_tokens`, on the
driver's loop, from the data path's reader: one call per sample per engine step, however many
tokens the step made (a speculating engine makes several).

What the caller has seen is also where a sample continues if its engine dies: `resume_point`
gives the runner the longer of the engine's last progress report and what was streamed, so a
moved sample never generates again what its caller already read.

Owns: each sample's streamed tokens and records, their order (a delta that overlaps what was
sent adds only what is new), the resume point. Does not own: the finished groups (the caller's
`Submission`), what the caller does with the tokens (`rollout.serve.backend`).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from rollout.log import get_logger
from rollout.packed import Logprobs, TokenIds
from rollout.types import Delta, Request, Trajectory

log = get_logger(__name__)
OnTokens = Callable[[int, int, list[int], list[float]], None]  # (sample index, position, token ids, logprobs)


class TokenStream:
    """One streamed prompt's samples so far; `on_tokens(sample_index, start, ids, logprobs)` gets
    each one's new tokens."""

    __slots__ = ("on_tokens", "samples")

    def __init__(self, on_tokens: OnTokens):
        self.on_tokens = on_tokens
        self.samples: dict[int, Trajectory] = {}  # sample index -> its tokens and epoch records so far

    def put(self, delta: Delta) -> None:
        """A delta from the sample's engine (the data path's callback)."""
        self._add(delta.start, delta.sample)

    def resume_point(self, request: Request, report: Trajectory | None) -> Trajectory | None:
        """Where a sample whose engine died continues: the engine's last progress report, or what
        was streamed of it if that is longer. A report longer than the stream first streams the
        difference (the caller sees every token once, in order, whichever engine made it)."""
        so_far = self.samples.get(request.sample_index)
        have = len(so_far.token_ids) if so_far is not None else 0
        if report is not None and (report.finished_at or len(report.token_ids) >= have):
            if len(report.token_ids) > have:
                part = msgspec.structs.replace(
                    report, token_ids=report.token_ids[have:], logprobs=report.logprobs[have:]
                )
                self._add(have, part)
            return report
        if so_far is None or request.token_ids is None:  # a text prompt: its ids are in reports only
            return report
        return msgspec.structs.replace(
            so_far, request_id=request.request_id, prompt_id=request.prompt_id,
            prompt_token_ids=TokenIds(request.token_ids), token_ids=TokenIds(so_far.token_ids),
            logprobs=Logprobs(so_far.logprobs), policy_epochs=list(so_far.policy_epochs),
            kv_recomputes=list(so_far.kv_recomputes), finished_at=0.0,
        )  # fmt: skip

    def _add(self, start: int, part: Trajectory) -> None:
        k = part.sample_index
        so_far = self.samples.get(k)
        have = len(so_far.token_ids) if so_far is not None else 0
        if start > have:  # never sent in order: a defect at the engine's edge; the end brings every token
            log.error("stream: a delta skips tokens", sample=k, expected=have, got=start)
            return
        ids, lps = list(part.token_ids[have - start :]), list(part.logprobs[have - start :])
        if not ids:
            return
        if so_far is None:
            so_far = self.samples[k] = Trajectory(sample_index=k, token_ids=[], logprobs=[])
        so_far.token_ids.extend(ids)
        so_far.logprobs.extend(lps)
        so_far.policy_epochs, so_far.kv_recomputes = list(part.policy_epochs), list(part.kv_recomputes)
        so_far.kv_reused, so_far.cache_salt = part.kv_reused, part.cache_salt
        so_far.first_token_at, so_far.engine_id = part.first_token_at, part.engine_id
        self.on_tokens(k, have, ids, lps)
