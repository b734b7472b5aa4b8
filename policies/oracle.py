"""The logprob oracle: replays finished trajectories with HF transformers in float32.

Owns: rebuilding, for every generated token, the exact forward pass the engine ran (which weight
epoch, which KV entries were reused across weight swaps, where the KV cache was recomputed) and
its raw logprob; comparing those with a trajectory's behaviour logprobs (`compare`); the CLI
`python -m policies.oracle --model DIR --weights EPOCH=DIR ... TRAJECTORIES.jsonl`.
Does not own: running or updating engines (see `policies.vllm_policy`).

Semantics (prompt at positions 0..P-1, generated g_i at P+i): the logits of g_i come from the
step whose last input position is P+i-1, run with the weights of g_i's policy epoch. The step of
g_0 processes the whole prompt; a recompute `(j, epoch)` drops the KV cache and reprocesses
positions 0..P+j-1 before g_j; otherwise a step processes only position P+i-1 and attends to KV
entries written earlier, possibly by older weights. Logprobs are log_softmax of the raw logits.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rollout.types import Trajectory, expand_runs

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
    ) -> list[float]:
        """The raw float32 logprob of every generated token, replayed as the engine computed it.

        One forward pass per segment of tokens sharing an epoch and a cache history. Raises
        KeyError for an epoch without weights, ValueError for bad token ids, runs or recomputes.
        """
        import torch
        from transformers import DynamicCache

        p, t = len(prompt_token_ids), len(token_ids)
        if t == 0:
            return []
        if p == 0:
            raise ValueError("oracle: an empty prompt has no logits for the first generated token")
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
        cache = None
        with torch.no_grad():
            for a, b in zip(starts, [*starts[1:], t]):
                if a in fresh:
                    cache, first = DynamicCache(), 0
                else:
                    first = p + a - 1
                logits = self.model(epochs[a])(
                    input_ids=full[:, first : p + b - 1], past_key_values=cache, use_cache=True
                ).logits[0, p + a - 1 - first :]
                logp = torch.log_softmax(logits.float(), dim=-1)
                out.extend(logp.gather(-1, full[0, p + a : p + b, None])[:, 0].tolist())
        return out

    def replay_trajectory(self, traj: Trajectory) -> list[float]:
        """`replay` with a trajectory's tokens, epoch runs and KV recomputes."""
        return self.replay(
            traj.prompt_token_ids, traj.token_ids, traj.policy_epochs, traj.kv_recomputes
        )


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
    failures: list[TrajectoryFailure] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_trajectories == 0


def compare(
    oracle: Oracle, trajectories: Iterable[Trajectory], atol: float = 1e-3, max_failures: int = 20
) -> OracleReport:
    """Replay every trajectory and count tokens whose |oracle - behaviour| logprob exceeds `atol`.

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
        if len(traj.logprobs) != len(traj.token_ids):
            fail(TrajectoryFailure(traj.request_id, f"{len(traj.logprobs)} logprobs for {len(traj.token_ids)} tokens"))
            continue
        errors = [abs(x - y) for x, y in zip(oracle.replay_trajectory(traj), traj.logprobs)]
        errors = [math.inf if math.isnan(e) else e for e in errors]
        report.tokens += len(errors)
        bad = [i for i, e in enumerate(errors) if e > atol]
        if errors and max(errors) > report.max_abs_err:
            report.max_abs_err = max(errors)
            report.worst_request_id, report.worst_index = traj.request_id, errors.index(report.max_abs_err)
        if bad:
            report.mismatched += len(bad)
            fail(TrajectoryFailure(traj.request_id, "logprob mismatch", len(bad), bad[0], max(errors)))
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
        report = compare(Oracle(resolve_model_path(args.model), weights), trajs, atol=args.atol)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(e.args[0] if e.args else e, file=sys.stderr)
        return 1
    print(msgspec.json.format(msgspec.json.encode(report)).decode())
    print("oracle: OK" if report.ok else f"oracle: {report.failed_trajectories} trajectories disagree")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
