"""The logprob oracle: replays finished trajectories with HF transformers in float32.

Owns: rebuilding, for every generated token, the exact forward pass the engine ran (which weight
epoch, which KV entries were reused across weight swaps, where the KV cache was recomputed) and
the logprob the engine reports from it (`Processing`: vLLM's processed or raw logprobs); comparing
those with a trajectory's behaviour logprobs (`compare`); the CLI
`python -m policies.oracle --model DIR --weights EPOCH=DIR ... TRAJECTORIES.jsonl`.
Does not own: running or updating engines (see `policies.vllm_policy`).

Semantics (prompt at positions 0..P-1, generated g_i at P+i): the logits of g_i come from the
step whose last input position is P+i-1, run with the weights of g_i's policy epoch. The step of
g_0 processes the whole prompt; a recompute `(j, epoch)` drops the KV cache and reprocesses
positions 0..P+j-1 before g_j; otherwise a step processes only position P+i-1 and attends to KV
entries written earlier, possibly by older weights.

Logprobs (README, "Behaviour logprobs"): `raw` is log_softmax of the model's logits. `processed`
is what vLLM's sampler samples from, computed as vLLM does in float32: stop tokens masked while
fewer than `min_tokens` are generated, logits divided by the temperature (by 1 at temperature 0),
then top-k (keep logits >= the k-th largest), then top-p (over the ascending sort, drop tokens
whose cumulative probability is <= 1 - top_p, always keeping the largest), then log_softmax.
Where a token sits on the top-p cut within float error (`TOP_P_EPS`), or the k-th and (k+1)-th
logits are within float error (`TOP_K_EPS`: the engine may keep both, or exactly k, and its top-p
cut then falls elsewhere), every such cut is accepted and the token counted in
`OracleReport.ambiguous`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rollout.epochs import expand_runs
from rollout.types import Trajectory

WeightsSource = Mapping[str, Any] | str | Path  # param name -> torch.Tensor, or a safetensors dir
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
        if cut is not x:  # the sampled token within float error of another's logit: the engine may order them the other way
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
            kept = [row.masked_fill(row < kth, -math.inf), row.masked_fill(~exact, -math.inf), row.masked_fill(~(sure | band), -math.inf)]
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


class Oracle:
    """Float32 reference replays of one model architecture under several weight epochs."""

    def __init__(self, model_dir: str | Path, weights: Mapping[int, WeightsSource]) -> None:
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(model_dir)
        self.vocab_size: int = self.config.get_text_config().vocab_size
        self._weights = dict(weights)
        self._models: dict[int, Any] = {}

    def model(self, epoch: int) -> Any:
        """The float32 model of `epoch`, built on first use. KeyError when the epoch has no weights."""
        if epoch not in self._models:
            if epoch not in self._weights:
                raise KeyError(f"oracle: no weights for epoch {epoch} (have {sorted(self._weights)})")
            self._models[epoch] = self._build(epoch, self._weights[epoch])
        return self._models[epoch]

    def _build(self, epoch: int, source: WeightsSource) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        state = _load_state_dict(source) if isinstance(source, str | Path) else source
        model = AutoModelForCausalLM.from_config(self.config, attn_implementation="eager", dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in state if k in params}
        untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
        if untied or unexpected:
            raise ValueError(f"oracle: weights of epoch {epoch}: missing {untied[:5]}, unexpected {unexpected[:5]}")
        return model.eval().requires_grad_(False)

    def replay(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        policy_epochs: Sequence[tuple[int, int]],
        kv_recomputes: Iterable[tuple[int, int]] = (),
        processing: Processing = Processing(),
    ) -> list[float]:
        """The float32 logprob of every generated token, replayed as the engine computed it.

        One forward pass per segment of tokens sharing an epoch and a cache history. Raises
        KeyError for an epoch without weights, ValueError for bad token ids, runs or recomputes.
        """
        return self.replay_both(prompt_token_ids, token_ids, policy_epochs, kv_recomputes, processing)[0]

    def replay_both(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        policy_epochs: Sequence[tuple[int, int]],
        kv_recomputes: Iterable[tuple[int, int]] = (),
        processing: Processing = Processing(),
    ) -> tuple[list[float], list[list[float]]]:
        """`replay`, and per token the logprobs the engine may have reported instead (`Processing.logprobs_of`)."""
        out, alt, _ = self._replay(prompt_token_ids, token_ids, policy_epochs, kv_recomputes, processing)
        return out, alt

    def replay_episode(self, turns: Sequence[Trajectory], processing: Processing = Processing()) -> list[tuple[list[float], list[list[float]]]]:
        """`replay_both` of each turn of an episode, the KV cache carried from turn to turn: a turn's
        first `kv_reused` prompt positions keep the KV the turns before computed, the rest is
        computed by its first step (each turn's prompt is the one before + its tokens + the
        observation, so every turn continues the same sequence)."""
        out, cache = [], None
        for k, turn in enumerate(turns):
            reused = turn.kv_reused if k else 0
            lp, alt, cache = self._replay(
                turn.prompt_token_ids, turn.token_ids, turn.policy_epochs, turn.kv_recomputes, processing, cache, reused
            )
            out.append((lp, alt))
        return out

    def _replay(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        policy_epochs: Sequence[tuple[int, int]],
        kv_recomputes: Iterable[tuple[int, int]],
        processing: Processing,
        cache: Any = None,
        reused: int = 0,
    ) -> tuple[list[float], list[list[float]], Any]:
        import torch
        from transformers import DynamicCache

        p, t = len(prompt_token_ids), len(token_ids)
        if t == 0:
            return [], [], cache
        if p == 0:
            raise ValueError("oracle: an empty prompt has no logits for the first generated token")
        if reused and (cache is None or not 0 < reused < p or cache.get_seq_length() < reused):
            have = cache.get_seq_length() if cache is not None else 0
            raise ValueError(f"oracle: {reused} reused positions of a {p}-token prompt, {have} computed before")
        ids = [*prompt_token_ids, *token_ids]
        bad = [x for x in ids if not 0 <= x < self.vocab_size]
        if bad:
            raise ValueError(f"oracle: token ids out of vocab [0, {self.vocab_size}): {bad[:5]}")
        epochs = expand_runs([tuple(r) for r in policy_epochs], t)
        fresh = {0}
        for j, epoch in kv_recomputes:
            if not 0 <= j < t or epochs[j] != epoch:
                raise ValueError(f"oracle: recompute ({j}, {epoch}) is not at a token of policy epoch {epoch}")
            fresh.add(j)
        starts = sorted(fresh | {start for start, _ in policy_epochs})
        full = torch.tensor([ids], dtype=torch.long)
        out: list[float] = []
        alt: list[list[float]] = []
        with torch.no_grad():
            for a, b in zip(starts, [*starts[1:], t]):
                if a == 0 and reused:  # the turns before computed these positions; this turn reused them
                    if drop := cache.get_seq_length() - reused:
                        cache.crop(-drop)
                    first = reused
                elif a in fresh:
                    cache, first = DynamicCache(), 0
                else:
                    first = p + a - 1
                logits = self.model(epochs[a])(
                    input_ids=full[:, first : p + b - 1], past_key_values=cache, use_cache=True
                ).logits[0, p + a - 1 - first :]
                lp, other = processing.logprobs_of(logits, full[0, p + a : p + b], a)
                out.extend(lp.tolist())
                alt.extend(other)
        return out, alt, cache

    def replay_trajectory(self, traj: Trajectory, processing: Processing = Processing()) -> list[float]:
        """`replay` with a trajectory's tokens, epoch runs and KV recomputes."""
        return self.replay(traj.prompt_token_ids, traj.token_ids, traj.policy_epochs, traj.kv_recomputes, processing)


def _load_state_dict(directory: str | Path) -> dict[str, Any]:
    """All tensors of the `*.safetensors` files of an HF directory (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"oracle: no *.safetensors in {str(directory)!r}")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(f))
    return state


class TrajectoryFailure(msgspec.Struct):
    """One trajectory whose behaviour logprobs disagree with the oracle."""

    request_id: str
    reason: str
    mismatched: int = 0
    first_index: int = -1  # first mismatched token
    max_abs_err: float = 0.0
    token_id: int = -1  # the token at `first_index`, its oracle and behaviour logprobs
    oracle_logprob: float = 0.0
    behaviour_logprob: float = 0.0


class OracleReport(msgspec.Struct):
    """Oracle vs behaviour logprobs over many trajectories; `failures` keeps the first few."""

    atol: float
    trajectories: int = 0
    tokens: int = 0
    mismatched: int = 0
    max_abs_err: float = 0.0
    worst_request_id: str = ""
    worst_index: int = -1  # token index of the worst error in `worst_request_id`
    failed_trajectories: int = 0
    ambiguous: int = 0  # tokens matched with the top-p or top-k cut moved across a token within float error
    failures: list[TrajectoryFailure] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_trajectories == 0


def compare(
    oracle: Oracle,
    trajectories: Iterable[Trajectory],
    atol: float = 1e-3,
    max_failures: int = 20,
    processing: Processing | Callable[[Trajectory], Processing] = Processing(),
) -> OracleReport:
    """Replay every trajectory and count tokens whose |oracle - behaviour| logprob exceeds `atol`.

    `processing`: how the engine computed the logprobs (the requests' sampling values and
    `sampling.logprobs`), one for all or a function of the trajectory. An episode (`turns` set)
    is replayed turn by turn with its KV carried over; token indices then count its model tokens.
    A NaN on either side counts as an infinite error; a trajectory with fewer or more logprobs
    than tokens fails whole.
    """
    report = OracleReport(atol=atol)

    def fail(failure: TrajectoryFailure) -> None:
        report.failed_trajectories += 1
        if len(report.failures) < max_failures:
            report.failures.append(failure)

    for traj in trajectories:
        report.trajectories += 1
        if short := [t for t in (traj.turns or [traj]) if len(t.logprobs) != len(t.token_ids)]:
            fail(TrajectoryFailure(traj.request_id, f"{len(short[0].logprobs)} logprobs for {len(short[0].token_ids)} tokens"))
            continue
        how = processing(traj) if callable(processing) else processing
        if traj.turns:  # an episode: its model turns, the KV carried from turn to turn
            replays = oracle.replay_episode(traj.turns, how)
            exact, moved = [x for lp, _ in replays for x in lp], [x for _, alt in replays for x in alt]
            behaviour = [x for turn in traj.turns for x in turn.logprobs]
        else:
            exact, moved = oracle.replay_both(traj.prompt_token_ids, traj.token_ids, traj.policy_epochs, traj.kv_recomputes, how)
            behaviour = traj.logprobs
        errors = []
        for x, alts, y in zip(exact, moved, behaviour):
            e = abs(x - y)
            if alts and (other := min(abs(a - y) for a in alts)) < e:  # a cut within float error of a token: either side will do
                report.ambiguous += 1
                e = other
            errors.append(math.inf if math.isnan(e) else e)
        report.tokens += len(errors)
        bad = [i for i, e in enumerate(errors) if e > atol]
        if errors and max(errors) > report.max_abs_err:
            report.max_abs_err = max(errors)
            report.worst_request_id, report.worst_index = traj.request_id, errors.index(report.max_abs_err)
        if bad:
            report.mismatched += len(bad)
            i = bad[0]
            token = [x for turn in (traj.turns or [traj]) for x in turn.token_ids][i]
            fail(TrajectoryFailure(traj.request_id, "logprob mismatch", len(bad), i, max(errors), int(token), exact[i], behaviour[i]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: replay a JSONL of trajectories, print the report as JSON; exit 0 when all agree."""
    from policies.tiny import resolve_model_path

    parser = argparse.ArgumentParser(prog="python -m policies.oracle", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="'tiny' or an HF model directory (its config.json)")
    parser.add_argument(
        "--weights", action="append", required=True, metavar="EPOCH=DIR", help="safetensors dir of one epoch"
    )
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--logprobs", choices=("processed", "raw"), default="processed", help="sampling.logprobs of the run")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--stop-token-ids", default="2", help="comma-separated ids ending a request (stop ids and EOS)")
    parser.add_argument("trajectories", type=Path, help="JSONL, one msgspec-JSON Trajectory per line")
    args = parser.parse_args(argv)
    weights: dict[int, WeightsSource] = {}
    for item in args.weights:
        epoch, sep, directory = item.partition("=")
        if not sep or not epoch.strip().lstrip("-").isdigit():
            parser.error(f"--weights: expected EPOCH=DIR, got {item!r}")
        weights[int(epoch)] = directory
    decoder = msgspec.json.Decoder(Trajectory)
    with args.trajectories.open("rb") as f:
        trajs = [decoder.decode(line) for line in f if line.strip()]
    try:
        stops = tuple(int(x) for x in args.stop_token_ids.split(",") if x.strip())
        how = Processing(args.logprobs, args.temperature, args.top_k, args.top_p, args.min_tokens, stops)
        report = compare(Oracle(resolve_model_path(args.model), weights), trajs, atol=args.atol, processing=how)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(e.args[0] if e.args else e, file=sys.stderr)
        return 1
    print(msgspec.json.format(msgspec.json.encode(report)).decode())
    print("oracle: OK" if report.ok else f"oracle: {report.failed_trajectories} trajectories disagree")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
