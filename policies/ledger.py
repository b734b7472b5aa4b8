"""The epoch ledger of one engine: turns what vLLM hands back per request into exact epoch records.

A sample runs as one or more *pieces* (vLLM requests): the whole sample, or, after an update aborted
it (`abort_resume`), vLLM evicted it for KV cache (`EVICTED`) or another engine died with it, a
continuation from prompt + the tokens so far. Each finished piece comes back with its tokens,
logprobs and vLLM's weight-version spans (the epoch of the step that sampled each token). This
module owns the rules that turn pieces into a `Trajectory`'s `policy_epochs` and `kv_recomputes`:
- a piece after tokens (a continuation) prefilled prompt + those tokens anew: a KV recompute at its
  first token, with the epoch that token was sampled at;
- in `recompute` mode every update inside a piece recomputes the KV (vLLM resets the cache);
- a piece whose first token was not sampled in the epoch it was submitted at (`salt`) may have had
  its prompt computed partly, or found in the prefix cache, under other weights: in `keep` and
  `abort_resume` it is discarded and run again (`Verdict.RERUN`);
- an episode's turn (`Piece.reuses`) is salted with its episode's cache salt, so its prompt reuses
  the KV the turns before left in vLLM's prefix cache, whatever weights computed it; vLLM reports
  how many positions it reused (`kv_reused`); the rest is computed by the turn's first step.
Pure Python, no vLLM: `tests/test_ledger.py` drives it through `VLLMPolicy` against a fake engine
with random update, abort and eviction timing.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from rollout.epochs import append_run
from rollout.types import Trajectory

Spans = list[tuple[int, int]]  # (first token within the piece, epoch)


class Piece:
    """One vLLM request: a whole sample, or the part of it since its last resubmission."""

    __slots__ = ("id", "salt", "cache_salt", "carry", "reuses", "resubmit", "started", "state")

    def __init__(self, piece_id: str, salt: int, cache_salt: str = "", carry: str = "", reuses: bool = False) -> None:
        self.id = piece_id
        self.salt = salt  # the epoch it was submitted at
        self.cache_salt = cache_salt or f"epoch-{salt}"  # its prefix-cache salt
        self.carry = carry  # an episode's turn: the salt its episode's next turn passes (`Trajectory.cache_salt`)
        self.reuses = reuses  # an episode's turn: its prompt may reuse the KV of the turns before
        self.resubmit = False  # an update aborted it: continue as a new piece
        self.started = False  # vLLM has produced its first token
        self.state: Any = None  # the frontend's handle on its progress in vLLM, once found


class Verdict(enum.Enum):
    DONE = "done"  # the sample is finished
    CONTINUE = "continue"  # tokens kept; the sample goes on as a new piece (prompt + tokens so far)
    RERUN = "rerun"  # nothing of this piece kept; it runs again from where it started


def mergeable(spans: Spans, piece: Piece, mode: str) -> bool:
    """False when a piece's output must be thrown away: its first token came from other weights
    than those it was submitted under, so its prompt's KV may mix epochs (`keep`, `abort_resume`;
    `recompute` and `drain` clear the cache at every update instead)."""
    return not (spans and spans[0][1] != piece.salt and mode in ("keep", "abort_resume"))


def reused(piece: Piece, spans: Spans, cached: int) -> int:
    """Prompt positions of an episode's turn that kept the KV of the turns before: what vLLM found
    in its prefix cache, unless an update cleared the cache before the first token (recompute)."""
    return cached if piece.reuses and spans and spans[0][1] == piece.salt else 0


def merge_piece(traj: Trajectory, spans: Spans, ids: list[int], lps: list[float], mode: str) -> None:
    """Append a piece's tokens to `traj`; `spans` are its (first token within the piece, epoch)."""
    fold_spans(traj, len(traj.token_ids), spans, len(ids), mode)
    traj.token_ids.extend(ids)
    traj.logprobs.extend(lps)


def fold_spans(traj: Trajectory, done: int, spans: Spans, n: int, mode: str) -> None:
    """Fold the epoch spans of a piece's first `n` tokens, which follow the `done` tokens before
    it, into `traj`'s `policy_epochs` and `kv_recomputes`."""
    for start, epoch in spans:
        if start >= n:  # labels a step whose token never reached us: no run over no token
            break
        start += done
        # A piece after tokens prefills them anew; in recompute mode every update inside a piece
        # recomputes the KV.
        if start > 0 and (mode == "recompute" or start == done):
            traj.kv_recomputes.append((start, epoch))  # every KV entry before `start` recomputed
        append_run(traj.policy_epochs, start, epoch)


def settle(
    traj: Trajectory,
    piece: Piece,
    spans: Spans,
    ids: list[int],
    lps: list[float],
    reason: str,
    evicted: bool,
    cached: int,
    mode: str,
) -> Verdict:
    """Fold a finished piece into `traj`; say whether the sample is done, goes on, or reruns it.

    `reason`: vLLM's finish reason; `evicted`: vLLM ended it for KV cache (the adapter's
    `EVICTED`); `cached`: prompt positions vLLM found in its prefix cache (an episode's turn
    records them as `kv_reused`). Raises ValueError when tokens came back without weight versions:
    their epochs would be unknown, and no epoch is ever guessed.
    """
    if ids and not spans:
        raise ValueError(f"vLLM returned {len(ids)} tokens of {piece.id} without weight versions")
    if piece.resubmit and mode != "abort_resume" and not ids:
        return Verdict.RERUN  # aborted before its first token: run it whole again
    if not mergeable(spans, piece, mode):
        return Verdict.RERUN
    if ids and not traj.token_ids:
        traj.kv_reused = reused(piece, spans, cached)
    traj.cache_salt = piece.carry
    merge_piece(traj, spans, ids, lps, mode)
    traj.finish_reason = reason if reason in ("stop", "length", "abort") else "stop"
    if reason == "abort" and (piece.resubmit or evicted):
        return Verdict.CONTINUE
    return Verdict.DONE


def snapshot(
    traj: Trajectory, piece: Piece | None, so_far: tuple[list[int], list[float], Spans, int] | None, mode: str
) -> Trajectory:
    """`traj` as far as its epochs are exact, for a progress report: a copy, plus what vLLM has
    produced of its running `piece` so far (`so_far`), unless that piece would be rerun."""
    t = msgspec.structs.replace(
        traj, token_ids=list(traj.token_ids), logprobs=list(traj.logprobs),
        policy_epochs=list(traj.policy_epochs), kv_recomputes=list(traj.kv_recomputes),
    )  # fmt: skip
    if piece is not None and so_far is not None and not traj.finished_at:
        ids, lps, spans, cached = so_far
        n = min(len(ids), len(lps))
        if n and spans and mergeable(spans, piece, mode):
            if not t.token_ids:
                t.kv_reused = reused(piece, spans, cached)
            t.cache_salt = piece.carry
            merge_piece(t, [s for s in spans if s[0] < n], ids[:n], lps[:n], mode)
    return t


def streamed(
    traj: Trajectory,
    piece: Piece | None,
    part: tuple[list[int], list[float], Spans, int, int] | None,
    mode: str,
    sent: int,
) -> Trajectory | None:
    """A streamed sample's tokens past its first `sent` (`rollout.types.Delta.sample`), as far as
    its epochs are exact: those of its finished pieces not sent yet, then what vLLM has produced
    of its running `piece` past them (`part`: ids and logprobs from the piece's `skip`-th token
    on, the piece's spans, prompt positions cached, `skip`). A piece that will be rerun adds
    nothing: its tokens never reach the trajectory, so they are never sent. None: nothing new."""
    done = len(traj.token_ids)
    head_ids, head_lps = traj.token_ids[sent:done], traj.logprobs[sent:done]
    ids: list[int] = []
    lps: list[float] = []
    spans: Spans = []
    if piece is not None and part is not None:
        ids, lps, spans, cached, skip = part
        n = min(len(ids), len(lps))
        if n and spans and mergeable(spans, piece, mode):
            ids, lps = ids[:n], lps[:n]
        else:
            ids, lps = [], []
    if not ids and not head_ids:
        return None
    t = msgspec.structs.replace(
        traj, prompt_token_ids=[], token_ids=head_ids + ids, logprobs=head_lps + lps,
        policy_epochs=list(traj.policy_epochs), kv_recomputes=list(traj.kv_recomputes),
    )  # fmt: skip
    if ids:
        assert piece is not None
        if not done:
            t.kv_reused = reused(piece, spans, cached)
        t.cache_salt = piece.carry
        fold_spans(t, done, spans, skip + len(ids), mode)
    return t
