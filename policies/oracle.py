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

Logprobs: `policies.processing` (vLLM's processed or raw logprobs, and the cuts float error may move).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from policies.processing import Processing
from rollout.epochs import expand_runs
from rollout.types import Trajectory

WeightsSource = Mapping[str, Any] | str | Path  # param name -> torch.Tensor, or a safetensors dir


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

    def replay_episode(
        self, turns: Sequence[Trajectory], processing: Processing = Processing()
    ) -> list[tuple[list[float], list[list[float]]]]:
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
            fail(
                TrajectoryFailure(
                    traj.request_id, f"{len(short[0].logprobs)} logprobs for {len(short[0].token_ids)} tokens"
                )
            )
            continue
        how = processing(traj) if callable(processing) else processing
        if traj.turns:  # an episode: its model turns, the KV carried from turn to turn
            replays = oracle.replay_episode(traj.turns, how)
            exact, moved = [x for lp, _ in replays for x in lp], [x for _, alt in replays for x in alt]
            behaviour = [x for turn in traj.turns for x in turn.logprobs]
        else:
            exact, moved = oracle.replay_both(
                traj.prompt_token_ids, traj.token_ids, traj.policy_epochs, traj.kv_recomputes, how
            )
            behaviour = traj.logprobs
        errors = []
        for x, alts, y in zip(exact, moved, behaviour):
            e = abs(x - y)
            if (
                alts and (other := min(abs(a - y) for a in alts)) < e
            ):  # a cut within float error of a token: either side will do
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
            fail(
                TrajectoryFailure(
                    traj.request_id, "logprob mismatch", len(bad), i, max(errors), int(token), exact[i], behaviour[i]
                )
            )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: replay a JSONL of trajectories, print the report as JSON; exit 0 when all agree."""
    from rollout.tiny import resolve_model_path

    parser = argparse.ArgumentParser(prog="python -m policies.oracle", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="'tiny' or an HF model directory (its config.json)")
    parser.add_argument(
        "--weights", action="append", required=True, metavar="EPOCH=DIR", help="safetensors dir of one epoch"
    )
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument(
        "--logprobs", choices=("processed", "raw"), default="processed", help="sampling.logprobs of the run"
    )
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
