"""The config's `speculative:` block: speculative decoding, checked when the config loads.

Owns: the block's fields (each documented by the string under it, which the config reference
renders), vLLM's speculative method names, the checks between the fields, and the one way in
(raw engine args that would set speculation are refused). `rollout.config` holds it in `Config`.
Does not own: checking the names against the installed vLLM (`policies.vllm_args`), or the
figures (`rollout.metrics.specdecode`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from rollout.types import PositiveInt

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
    """vLLM's speculative method (`ngram`, `ngram_gpu`, `suffix`, `draft_model`, `eagle`, `eagle3`,
    `medusa`, `mtp`, the `*_mtp` aliases, ...); null: speculation off."""
    num_speculative_tokens: PositiveInt | None = None
    """Draft tokens proposed per step; required for `ngram`, a draft model's config may give it."""
    prompt_lookup_min: PositiveInt | None = None
    """`ngram` only: the shortest context n-gram to match."""
    prompt_lookup_max: PositiveInt | None = None
    """`ngram` only: the longest context n-gram to match."""
    model: str | None = None
    """The draft model or EAGLE head directory; required for `draft_model`, `eagle`, `eagle3`,
    `medusa`, `mlp_speculator`, `dflash` and `custom_class`."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Any other field of vLLM's SpeculativeConfig, passed as is (names checked against the
    installed vLLM before engines start)."""

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


def check_raw_speculative_args(engine_args: dict[str, Any]) -> None:
    """One way in to speculation: raw engine args would bypass these checks and the metrics.

    Raises ValueError naming the `engines.vllm` key that sets speculation.
    """
    for key in _RAW_SPECULATIVE_ARGS:
        if key in engine_args:
            raise ValueError(
                f"engines.vllm.{key}: configure speculative decoding in the `speculative:` block "
                "(method, num_speculative_tokens, prompt_lookup_min/max, model; "
                "other vLLM fields under speculative.options)"
            )
