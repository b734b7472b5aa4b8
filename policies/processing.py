"""How vLLM turned logits into a behaviour logprob, replayed for the oracle (docs/design/epochs.md,
"Behaviour logprobs"). `raw` is log_softmax of the model's logits. `processed` is what vLLM's sampler samples from,
computed as vLLM does in float32: stop tokens masked while
fewer than `min_tokens` are generated, logits divided by the temperature (by 1 at temperature 0),
then top-k (keep logits >= the k-th largest), then top-p (over the ascending sort, drop tokens
whose cumulative probability is <= 1 - top_p, always keeping the largest), then log_softmax.
Where a token sits on the top-p cut within float error (`TOP_P_EPS`), or the k-th and (k+1)-th
logits are within float error (`TOP_K_EPS`: the engine may keep both, or exactly k, and its top-p
cut then falls elsewhere), or the sampled token's logit within float error of another's across a
cut (`TIE_EPS`: the engine may order them the other way), every such cut is accepted and the token
counted in `OracleReport.ambiguous` (`policies.oracle`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

# A top-p cut closer than this to a token's cumulative probability is ambiguous: engine and oracle
# logits agree to about the test tolerance (1e-3), so such a token can fall on either side.
TOP_P_EPS = 1e-3
# Likewise a top-k cut between logits (after temperature) closer than this.
TOP_K_EPS = 1e-3
# The sampled token's logit (after temperature) this close to another's: their order, and so which
# side of a top-k or top-p cut each falls, may be the other way in the engine.
TIE_EPS = 1e-3


class Processing(msgspec.Struct, frozen=True):
    """How the engine turned logits into the behaviour logprob (a request's sampling values).

    `Processing.of(sampling, stop_ids)` builds it from a `rollout.types.Sampling`; `stop_ids` are
    every token that ends a request (its stop_token_ids and the model's EOS), masked while fewer
    than `min_tokens` tokens are generated. `spec_tokens`: speculative decoding's draft tokens per
    step; vLLM masks a step's bonus token by the count at the step's start, so up to that many
    tokens past `min_tokens` may have been sampled with the stop ids still masked (either is accepted).
    """

    logprobs: str = "processed"  # or "raw"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    spec_tokens: int = 0

    @classmethod
    def of(cls, sampling: Any, stop_ids: Iterable[int] = ()) -> Processing:
        return cls(
            logprobs=sampling.logprobs, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_tokens=sampling.min_tokens, stop_ids=tuple(sorted({*sampling.stop_token_ids, *stop_ids})),
        )  # fmt: skip

    def logprobs_of(self, logits: Any, tokens: Any, first_index: int) -> tuple[Any, list[list[float]]]:
        """(logprob of each `tokens[i]` under `logits[i]`, and per row the logprobs the engine may
        have reported instead: where a top-k or top-p cut sits within float error of a token, or
        speculation leaves the stop mask open; [] elsewhere). Row i is generated token `first_index + i`."""
        import torch

        x = logits.float()
        alts: list[list[float]] = [[] for _ in range(x.shape[0])]
        if self.logprobs == "raw":
            return torch.log_softmax(x, dim=-1).gather(-1, tokens[:, None])[:, 0], alts
        x = x.clone()
        if self.stop_ids and first_index < self.min_tokens:
            rows = min(self.min_tokens - first_index, x.shape[0])
            x[:rows, list(self.stop_ids)] = -math.inf
        if self.temperature >= 1e-5:
            x = x / self.temperature
        cut, ambiguous = self._cut(x)
        lp = torch.log_softmax(cut, dim=-1).gather(-1, tokens[:, None])[:, 0]
        for r in ambiguous.nonzero().flatten().tolist():
            alts[r] = [torch.log_softmax(v, dim=-1)[tokens[r]].item() for v in self._variants(x[r], int(tokens[r]))]
        if (
            cut is not x
        ):  # the sampled token within float error of another's logit: the engine may order them the other way
            rows = torch.arange(x.shape[0])
            for shift in (TIE_EPS, -TIE_EPS):
                nudged = x.clone()
                nudged[rows, tokens] += shift
                kept = self._cut(nudged)[0] > -math.inf
                other = torch.log_softmax(x.masked_fill(~kept, -math.inf), dim=-1).gather(-1, tokens[:, None])[:, 0]
                for r in (other != lp).nonzero().flatten().tolist():
                    alts[r].append(other[r].item())
        lo, hi = self.min_tokens - first_index, self.min_tokens + self.spec_tokens + 1 - first_index
        if self.spec_tokens and self.stop_ids and hi > 0 and lo < x.shape[0]:
            masked = msgspec.structs.replace(self, min_tokens=self.min_tokens + self.spec_tokens + 1, spec_tokens=0)
            mlp, malts = masked.logprobs_of(logits, tokens, first_index)
            for r in range(max(lo, 0), min(hi, x.shape[0])):
                alts[r] += [mlp[r].item(), *malts[r]]
        return lp, alts

    def _cut(self, x: Any) -> tuple[Any, Any]:
        """vLLM's top-k then top-p mask of the rows of `x` (temperature applied; `x` itself when
        neither is set), and which rows have a cut within float error of a token."""
        import torch

        cut, ambiguous = x, torch.zeros(x.shape[0], dtype=torch.bool)
        if 0 < self.top_k < x.shape[-1]:
            top = x.topk(self.top_k + 1, dim=-1).values
            cut = x.masked_fill(x < top[:, -2:-1], -math.inf)
            ambiguous = (top[:, -2] - top[:, -1]) < TOP_K_EPS  # the k-th and the next within float error
        if self.top_p < 1.0:
            cut, near = _top_p(cut, self.top_p)
            ambiguous |= near
        return cut, ambiguous

    def _variants(self, row: Any, token: int) -> list[Any]:
        """The masked logits of one row (temperature applied) with each cut the engine's float error
        may have put elsewhere. Top-k: the engine keeps exactly k unless its own logits tie, so the
        tokens within `TOP_K_EPS` of the k-th may be kept all, or only as many as make k (the
        sampled one among them); then top-p on each, as cut and with its near tokens flipped."""
        kept = [row]
        if 0 < self.top_k < row.shape[-1]:
            kth = row.topk(self.top_k).values[-1]
            band = (row - kth).abs() < TOP_K_EPS
            sure = row >= kth + TOP_K_EPS
            order = sorted(band.nonzero().flatten().tolist(), key=lambda i: (i != token, -row[i].item()))
            exact = sure.clone()
            exact[order[: self.top_k - int(sure.sum())]] = True
            kept = [
                row.masked_fill(row < kth, -math.inf),
                row.masked_fill(~exact, -math.inf),
                row.masked_fill(~(sure | band), -math.inf),
            ]
        if self.top_p >= 1.0:
            return kept
        return [_top_p(k[None], self.top_p, flip_near=flip)[0][0] for k in kept for flip in (False, True)]


def _top_p(x: Any, p: float, flip_near: bool = False) -> tuple[Any, Any]:
    """vLLM's top-p mask of each row (`apply_top_k_top_p_pytorch`), and which rows have a token
    whose cumulative probability is within `TOP_P_EPS` of the cut. `flip_near`: the mask with
    those tokens on the other side of the cut."""
    import torch

    s, idx = x.sort(dim=-1, descending=False)
    cum = s.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - p
    drop[:, -1] = False
    near = (cum - (1 - p)).abs() < TOP_P_EPS
    near[:, -1] = False
    if flip_near:
        drop = torch.where(near, ~drop, drop)
    return x.scatter(-1, idx, s.masked_fill(drop, -math.inf)), near.any(dim=-1)
