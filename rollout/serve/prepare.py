"""Preparing a served request where it cannot stall the event loop, and the chat template with a
cheap bound in front of the tokenizer.

Owns: where a request's preparation (decoding, rendering, tokenizing) runs (`Preparer`: on the loop
for a small body, which takes well under a millisecond, else in worker threads, HEAVY_THREADS at a
time); refusing a prompt that cannot fit the context before tokenizing it (`ServedChat`).
Does not own: reading or decoding bodies (`rollout.serve.bodies`), routes (`rollout.serve.server`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from rollout.episodes.chat import ChatRenderer
from rollout.errors import InvalidConfigError
from rollout.log import get_logger
from rollout.serve import openai_api as api

log = get_logger(__name__)
T = TypeVar("T")
INLINE_BYTES = 64 * 2**10  # bodies up to this are prepared on the loop (decoding + rendering: ~1 ms)
HEAVY_THREADS = 2  # larger ones in worker threads, this many at a time (tokenizers release the GIL)
SLACK = 2  # Unicode normalization (NFC) may merge a few characters into fewer: the bound allows for it
_SAFE_NORMALIZERS = {"NFC", "NFKC", "Prepend", "Replace", "Sequence", "Lowercase"}  # none drops text


class ServedChat(ChatRenderer):
    """The model's chat template, with a cheap bound in front of the tokenizer: a text longer than
    SLACK x max_model_len x (longest vocabulary entry) characters cannot have max_model_len tokens
    or fewer (each token covers at most that many characters of text: one byte per character of a
    byte-level entry, one character per SentencePiece character, a special token its content), so
    it is refused as over the context without tokenizing it. Off (no bound) for a tokenizer whose
    normalizer may delete text (BERT's accent stripping), where the argument does not hold."""

    def __init__(self, model_dir: str | Path, max_model_len: int):
        self.max_chars: int | None = None  # unbounded while the parent finds the end-of-turn token
        super().__init__(model_dir)
        self.max_model_len = max_model_len
        longest = max((len(entry) for entry in self.tokenizer.get_vocab()), default=1)
        self.max_chars = SLACK * max_model_len * longest if _keeps_text(self.tokenizer) else None

    def encode(self, text: str) -> list[int]:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise api.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your messages have {len(text)} characters, "
                                    f"more than {self.max_chars} cannot fit it.", "messages")  # fmt: skip
        return super().encode(text)


def served_chat(model_dir: str | Path, max_model_len: int) -> ServedChat | None:
    """The model's chat template, or None when it has none (token ids only)."""
    try:
        return ServedChat(model_dir, max_model_len)
    except InvalidConfigError as e:
        log.warning("serve: no chat template, chat and text prompts are refused", reason=str(e))
        return None


def _keeps_text(tokenizer: Any) -> bool:
    """Whether the fast tokenizer's normalizer is one that never deletes characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    normalizer = json.loads(backend.to_str()).get("normalizer")
    pending = [normalizer] if normalizer else []
    while pending:
        step = pending.pop()
        if step.get("type") not in _SAFE_NORMALIZERS or (step.get("type") == "Replace" and not step.get("content")):
            return False
        pending.extend(step.get("normalizers") or [])
    return True


class Preparer:
    """Runs a request's preparation (`work(body)`: decode, check, render, tokenize) where it cannot
    stall the event loop: inline for a small body, else in a worker thread (HEAVY_THREADS at a time;
    the rest wait their turn without holding the loop)."""

    def __init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(HEAVY_THREADS)

    async def run(self, body: bytes, work: Callable[[bytes], T]) -> T:
        if len(body) <= INLINE_BYTES:
            return work(body)
        return await anyio.to_thread.run_sync(work, body, limiter=self.limiter)
