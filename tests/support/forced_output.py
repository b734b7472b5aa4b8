"""A test-only vLLM logits processor that makes the model write a given text, so tests can check
what is done with known output (vLLM's tool and reasoning parsers: tests/integration/test_parsers.py).

Enabled only where a test's engine config names it (`engines.vllm.logits_processors:
["tests.support.forced_output:ForcedOutput"]`). A request whose prompt holds `FORCE:` followed by text gets
that text's token ids (up to the prompt's next end-of-turn token) as its output, one per step,
then the end-of-turn token: every other logit is -inf. Any other request is left alone. The
engine, sampler and detokenizer are vLLM's own; only which token wins is decided here.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from rollout.tiny import EOS_ID, FIRST_BYTE_ID

MARKER = [FIRST_BYTE_ID + b for b in b"FORCE:"]  # the tiny model's byte tokens


def forced_ids(prompt: list[int]) -> list[int] | None:
    """The ids after the last `FORCE:` in the prompt, up to its next end-of-turn token, then that token."""
    starts = [i for i in range(len(prompt) - len(MARKER) + 1) if prompt[i : i + len(MARKER)] == MARKER]
    if not starts:
        return None
    rest = prompt[starts[-1] + len(MARKER) :]
    return rest[: rest.index(EOS_ID)] + [EOS_ID] if EOS_ID in rest else rest + [EOS_ID]


class ForcedOutput(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.forced: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (forced ids, output ids so far)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new(params, prompt: list[int] | None, output: list[int]):
            ids = forced_ids(list(prompt or []))
            return None if ids is None else (ids, output)

        process_dict_updates(self.forced, batch_update, new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (ids, output) in self.forced.items():
            token = ids[min(len(output), len(ids) - 1)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
